/* port_stm32l4r5.c: ST STM32L4R5ZI (NUCLEO-L4R5ZI), bare metal, no HAL.
 * Written from the STM32L4+ reference manual (RM0432) register map; not yet run on hardware.
 * Clock: 120 MHz from HSI16 through the PLL (16 MHz / 1 x 15 / 2), voltage range 1 in boost
 *   mode, 5 flash wait states with prefetch and caches; APB1 at 120 MHz.
 * Serial: LPUART1 at TD_SERIAL_BAUD (harness_config.h) 8N1 on PG7 (TX) and PG8 (RX), alternate function 8: the pins the
 *   on-board ST-LINK/V2-1 presents as its USB serial port. Port G sits on VDDIO2, which must be
 *   declared valid (PWR_CR2.IOSV) before the pins work.
 * Ticks and work counter: the DWT cycle counter (CPU cycles at 120 MHz). */
#include <stdint.h>
#include "port.h"
#include "harness_config.h"
#ifndef TD_SERIAL_BAUD
#define TD_SERIAL_BAUD 115200u
#endif

#define REG(addr) (*(volatile uint32_t *)(addr))

#define RCC_CR REG(0x40021000u)
#define RCC_CFGR REG(0x40021008u)
#define RCC_PLLCFGR REG(0x4002100Cu)
#define RCC_AHB2ENR REG(0x4002104Cu)
#define RCC_APB1ENR1 REG(0x40021058u)
#define RCC_APB1ENR2 REG(0x4002105Cu)
#define PWR_CR2 REG(0x40007004u)
#define PWR_CR5 REG(0x40007080u)
#define FLASH_ACR REG(0x40022000u)
#define GPIOG_MODER REG(0x48001800u)
#define GPIOG_AFRL REG(0x48001820u)
#define GPIOG_AFRH REG(0x48001824u)
#define LPUART1_CR1 REG(0x40008000u)
#define LPUART1_BRR REG(0x4000800Cu)
#define LPUART1_ISR REG(0x4000801Cu)
#define LPUART1_ICR REG(0x40008020u)
#define LPUART1_RDR REG(0x40008024u)
#define LPUART1_TDR REG(0x40008028u)
#define DEMCR REG(0xE000EDFCu)
#define DWT_CTRL REG(0xE0001000u)
#define DWT_CYCCNT REG(0xE0001004u)
#define SCB_AIRCR REG(0xE000ED0Cu)

#define CPU_HZ 120000000u
#define BAUD TD_SERIAL_BAUD            /* harness_config.h: the profile's or the board's rate */
/* LPUART: BRR = 256 * f_clk / baud (RM0432 "LPUART baud rate generation"), rounded. */
#define LPUART_BRR ((256ull * CPU_HZ + BAUD / 2u) / BAUD)

uint32_t startup_stack_used(uint32_t *reserved);

static uint32_t count_start;

static void clock_120mhz(void)
{
    volatile int i;
    RCC_APB1ENR1 |= 1u << 28;                          /* PWREN */
    (void)RCC_APB1ENR1;
    RCC_CFGR = (RCC_CFGR & ~(0xFu << 4)) | (8u << 4);  /* AHB / 2 while switching to boost mode */
    PWR_CR5 &= ~(1u << 8);                             /* R1MODE = 0: range 1 boost (up to 120 MHz) */
    FLASH_ACR = (FLASH_ACR & ~0xFu) | 5u | (1u << 8) | (1u << 9) | (1u << 10);   /* 5 WS, prefetch, I/D caches */
    while ((FLASH_ACR & 0xFu) != 5u) {
    }
    RCC_CR |= 1u << 8;                                 /* HSION */
    while (!(RCC_CR & (1u << 10))) {                   /* HSIRDY */
    }
    /* PLLSRC = HSI16 (2), PLLM = /1 (0), PLLN = 15, PLLR = /2 (0), PLLREN */
    RCC_PLLCFGR = 2u | (0u << 4) | (15u << 8) | (0u << 25) | (1u << 24);
    RCC_CR |= 1u << 24;                                /* PLLON */
    while (!(RCC_CR & (1u << 25))) {                   /* PLLRDY */
    }
    RCC_CFGR = (RCC_CFGR & ~3u) | 3u;                  /* SW = PLL */
    while (((RCC_CFGR >> 2) & 3u) != 3u) {             /* SWS */
    }
    for (i = 0; i < 200; ++i) {                        /* >= 1 us at the new clock before AHB / 1 */
    }
    RCC_CFGR &= ~(0xFu << 4);                          /* AHB / 1: 120 MHz */
}

void port_init(void)
{
    clock_120mhz();
    RCC_APB1ENR1 |= 1u << 28;
    PWR_CR2 |= 1u << 9;                                /* IOSV: VDDIO2 (port G) valid */
    RCC_AHB2ENR |= 1u << 6;                            /* GPIOGEN */
    (void)RCC_AHB2ENR;
    GPIOG_MODER = (GPIOG_MODER & ~((3u << 14) | (3u << 16))) | (2u << 14) | (2u << 16);   /* PG7, PG8: AF */
    GPIOG_AFRL = (GPIOG_AFRL & ~(0xFu << 28)) | (8u << 28);                            /* PG7: AF8 */
    GPIOG_AFRH = (GPIOG_AFRH & ~0xFu) | 8u;                                             /* PG8: AF8 */
    RCC_APB1ENR2 |= 1u;                                /* LPUART1EN (kernel clock: PCLK1) */
    (void)RCC_APB1ENR2;
    LPUART1_CR1 = 0u;
    LPUART1_BRR = (uint32_t)LPUART_BRR;
    LPUART1_CR1 = (1u << 3) | (1u << 2);               /* TE, RE */
    LPUART1_CR1 |= 1u;                                 /* UE */
    DEMCR |= 1u << 24;                                 /* TRCENA */
    DWT_CYCCNT = 0u;
    DWT_CTRL |= 1u;                                    /* CYCCNTENA */
}

void port_putc(char c)
{
    while (!(LPUART1_ISR & (1u << 7))) {               /* TXE */
    }
    LPUART1_TDR = (uint32_t)(unsigned char)c;
}

int port_getc(void)
{
    const uint32_t isr = LPUART1_ISR;
    if (isr & (1u << 3)) {                             /* ORE: a byte was lost while busy; go on */
        LPUART1_ICR = 1u << 3;
    }
    return (isr & (1u << 5)) ? (int)(LPUART1_RDR & 0xFFu) : -1;   /* RXNE */
}

uint32_t port_ticks(void)
{
    return DWT_CYCCNT;
}

uint32_t port_tick_hz(void)
{
    return CPU_HZ;
}

uint32_t port_us(void)
{
    return port_us_from_ticks();
}

void port_count_begin(void)
{
    count_start = DWT_CYCCNT;
}

uint32_t port_count_end(void)
{
    return DWT_CYCCNT - count_start;
}

const char *port_count_unit(void)
{
    return "cycles";
}

uint32_t port_stack_used(uint32_t *reserved)
{
    return startup_stack_used(reserved);
}

void port_exit(int code)
{
    (void)code;
    SCB_AIRCR = 0x05FA0004u;                           /* SYSRESETREQ: a fresh start */
    for (;;) {
    }
}
