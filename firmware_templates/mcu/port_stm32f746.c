/* port_stm32f746.c: ST STM32F746NG (32F746GDISCOVERY), bare metal, no HAL.
 * Written from the STM32F7 reference manual (RM0385) register map; not yet run on hardware.
 * Clock: 216 MHz from HSI (16 MHz / 8 x 216 / 2) with over-drive, 7 flash wait states, the ART
 *   accelerator and prefetch, the Cortex-M7 instruction cache; APB2 at 108 MHz, APB1 at 54 MHz.
 * Serial: USART1 at TD_SERIAL_BAUD (harness_config.h) 8N1 on PA9 (TX) and PB7 (RX), alternate function 7: the pins the
 *   on-board ST-LINK/V2-1 presents as its USB serial port.
 * Ticks and work counter: the DWT cycle counter (CPU cycles at 216 MHz). */
#include <stdint.h>
#include "port.h"
#include "harness_config.h"
#ifndef TD_SERIAL_BAUD
#define TD_SERIAL_BAUD 115200u
#endif

#define REG(addr) (*(volatile uint32_t *)(addr))

#define RCC_CR REG(0x40023800u)
#define RCC_PLLCFGR REG(0x40023804u)
#define RCC_CFGR REG(0x40023808u)
#define RCC_AHB1ENR REG(0x40023830u)
#define RCC_APB1ENR REG(0x40023840u)
#define RCC_APB2ENR REG(0x40023844u)
#define PWR_CR1 REG(0x40007000u)
#define PWR_CSR1 REG(0x40007004u)
#define FLASH_ACR REG(0x40023C00u)
#define GPIOA_MODER REG(0x40020000u)
#define GPIOA_AFRH REG(0x40020024u)
#define GPIOB_MODER REG(0x40020400u)
#define GPIOB_AFRL REG(0x40020420u)
#define USART1_CR1 REG(0x40011000u)
#define USART1_BRR REG(0x4001100Cu)
#define USART1_ISR REG(0x4001101Cu)
#define USART1_ICR REG(0x40011020u)
#define USART1_RDR REG(0x40011024u)
#define USART1_TDR REG(0x40011028u)
#define SCB_CCR REG(0xE000ED14u)
#define SCB_ICIALLU REG(0xE000EF50u)
#define SCB_AIRCR REG(0xE000ED0Cu)
#define DEMCR REG(0xE000EDFCu)
#define DWT_CTRL REG(0xE0001000u)
#define DWT_CYCCNT REG(0xE0001004u)
#define DWT_LAR REG(0xE0001FB0u)

#define CPU_HZ 216000000u
#define PCLK2_HZ 108000000u
#define BAUD TD_SERIAL_BAUD            /* harness_config.h: the profile's or the board's rate */

uint32_t startup_stack_used(uint32_t *reserved);

static uint32_t count_start;

static void clock_216mhz(void)
{
    RCC_APB1ENR |= 1u << 28;                           /* PWREN */
    (void)RCC_APB1ENR;
    PWR_CR1 |= 3u << 14;                               /* VOS: scale 1 */
    /* PLLM = 8 (2 MHz), PLLN = 216 (432 MHz VCO), PLLP = /2 (0), source HSI (bit 22 = 0), PLLQ = 9 */
    RCC_PLLCFGR = 8u | (216u << 6) | (0u << 16) | (9u << 24);
    RCC_CR |= 1u << 24;                                /* PLLON */
    while (!(RCC_CR & (1u << 25))) {                   /* PLLRDY */
    }
    PWR_CR1 |= 1u << 16;                               /* ODEN: over-drive, needed above 180 MHz */
    while (!(PWR_CSR1 & (1u << 16))) {                 /* ODRDY */
    }
    PWR_CR1 |= 1u << 17;                               /* ODSWEN */
    while (!(PWR_CSR1 & (1u << 17))) {                 /* ODSWRDY */
    }
    FLASH_ACR = 7u | (1u << 8) | (1u << 9);            /* 7 WS, prefetch, ART accelerator */
    while ((FLASH_ACR & 0xFu) != 7u) {
    }
    /* AHB / 1, APB1 / 4 (54 MHz), APB2 / 2 (108 MHz), then SW = PLL */
    RCC_CFGR = (RCC_CFGR & ~((7u << 10) | (7u << 13) | (0xFu << 4))) | (5u << 10) | (4u << 13);
    RCC_CFGR = (RCC_CFGR & ~3u) | 2u;
    while (((RCC_CFGR >> 2) & 3u) != 2u) {             /* SWS */
    }
}

static void icache_on(void)
{
    __asm__ volatile("dsb\n\tisb" ::: "memory");
    SCB_ICIALLU = 0u;                                  /* invalidate the instruction cache */
    __asm__ volatile("dsb\n\tisb" ::: "memory");
    SCB_CCR |= 1u << 17;                               /* IC */
    __asm__ volatile("dsb\n\tisb" ::: "memory");
}

void port_init(void)
{
    clock_216mhz();
    icache_on();
    RCC_AHB1ENR |= (1u << 0) | (1u << 1);              /* GPIOAEN, GPIOBEN */
    (void)RCC_AHB1ENR;
    GPIOA_MODER = (GPIOA_MODER & ~(3u << 18)) | (2u << 18);   /* PA9: AF */
    GPIOA_AFRH = (GPIOA_AFRH & ~(0xFu << 4)) | (7u << 4);     /* PA9: AF7 */
    GPIOB_MODER = (GPIOB_MODER & ~(3u << 14)) | (2u << 14);   /* PB7: AF */
    GPIOB_AFRL = (GPIOB_AFRL & ~(0xFu << 28)) | (7u << 28);   /* PB7: AF7 */
    RCC_APB2ENR |= 1u << 4;                            /* USART1EN (kernel clock: PCLK2) */
    (void)RCC_APB2ENR;
    USART1_CR1 = 0u;
    USART1_BRR = (PCLK2_HZ + BAUD / 2u) / BAUD;        /* oversampling by 16 */
    USART1_CR1 = (1u << 3) | (1u << 2);                /* TE, RE */
    USART1_CR1 |= 1u;                                  /* UE */
    DEMCR |= 1u << 24;                                 /* TRCENA */
    DWT_LAR = 0xC5ACCE55u;                             /* unlock the DWT (Cortex-M7) */
    DWT_CYCCNT = 0u;
    DWT_CTRL |= 1u;                                    /* CYCCNTENA */
}

void port_putc(char c)
{
    while (!(USART1_ISR & (1u << 7))) {                /* TXE */
    }
    USART1_TDR = (uint32_t)(unsigned char)c;
}

int port_getc(void)
{
    const uint32_t isr = USART1_ISR;
    if (isr & (1u << 3)) {                             /* ORE: a byte was lost while busy; go on */
        USART1_ICR = 1u << 3;
    }
    return (isr & (1u << 5)) ? (int)(USART1_RDR & 0xFFu) : -1;   /* RXNE */
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
