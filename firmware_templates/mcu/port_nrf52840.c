/* port_nrf52840.c: Nordic nRF52840 (Arduino Nano 33 BLE), bare metal, no SDK.
 * Written from the nRF52840 Product Specification's register map; not yet run on hardware.
 * Serial: UARTE0 (EasyDMA) at TD_SERIAL_BAUD (harness_config.h, 115200 by default) 8N1 on P1.03 (TX, Arduino D1) and P1.10 (RX, D0).
 *   Reception uses one-byte DMA transfers into two alternating buffers, restarted in hardware by
 *   the ENDRX->STARTRX shortcut; a byte arriving while the harness is busy (inferring) can be
 *   lost, which the protocol allows: the host waits for m-ready before sending.
 * Ticks: TIMER1, 32 bit, 16 MHz (prescaler 0), read by the CAPTURE[0] task.
 * Work counter: the Cortex-M4 DWT cycle counter (CPU cycles at 64 MHz), exact on the real chip.
 * Clock: the 64 MHz crystal (HFXO) is started for exact baud rates and timing. */
#include <stdint.h>
#include "port.h"
#include "harness_config.h"
#ifndef TD_SERIAL_BAUD
#define TD_SERIAL_BAUD 115200
#endif

#define REG(addr) (*(volatile uint32_t *)(addr))

/* CLOCK */
#define CLOCK_BASE 0x40000000u
#define CLOCK_TASKS_HFCLKSTART REG(CLOCK_BASE + 0x000u)
#define CLOCK_EVENTS_HFCLKSTARTED REG(CLOCK_BASE + 0x100u)

/* UARTE0 */
#define UARTE0_BASE 0x40002000u
#define UARTE_TASKS_STARTRX REG(UARTE0_BASE + 0x000u)
#define UARTE_TASKS_STOPRX REG(UARTE0_BASE + 0x004u)
#define UARTE_TASKS_STARTTX REG(UARTE0_BASE + 0x008u)
#define UARTE_TASKS_STOPTX REG(UARTE0_BASE + 0x00Cu)
#define UARTE_EVENTS_ENDRX REG(UARTE0_BASE + 0x110u)
#define UARTE_EVENTS_ENDTX REG(UARTE0_BASE + 0x120u)
#define UARTE_EVENTS_ERROR REG(UARTE0_BASE + 0x124u)
#define UARTE_EVENTS_RXSTARTED REG(UARTE0_BASE + 0x14Cu)
#define UARTE_SHORTS REG(UARTE0_BASE + 0x200u)
#define UARTE_ERRORSRC REG(UARTE0_BASE + 0x480u)
#define UARTE_ENABLE REG(UARTE0_BASE + 0x500u)
#define UARTE_PSEL_RTS REG(UARTE0_BASE + 0x508u)
#define UARTE_PSEL_TXD REG(UARTE0_BASE + 0x50Cu)
#define UARTE_PSEL_CTS REG(UARTE0_BASE + 0x510u)
#define UARTE_PSEL_RXD REG(UARTE0_BASE + 0x514u)
#define UARTE_BAUDRATE REG(UARTE0_BASE + 0x524u)
#define UARTE_RXD_PTR REG(UARTE0_BASE + 0x534u)
#define UARTE_RXD_MAXCNT REG(UARTE0_BASE + 0x538u)
#define UARTE_RXD_AMOUNT REG(UARTE0_BASE + 0x53Cu)
#define UARTE_TXD_PTR REG(UARTE0_BASE + 0x544u)
#define UARTE_TXD_MAXCNT REG(UARTE0_BASE + 0x548u)
#define UARTE_CONFIG REG(UARTE0_BASE + 0x56Cu)
#define UARTE_SHORTS_ENDRX_STARTRX (1u << 5)
#define UARTE_ENABLE_ENABLED 8u
/* BAUDRATE register values (nRF52840 product specification, UARTE BAUDRATE) for TD_SERIAL_BAUD */
#if TD_SERIAL_BAUD == 115200
#define UARTE_BAUD 0x01D7E000u
#elif TD_SERIAL_BAUD == 230400
#define UARTE_BAUD 0x03AFB000u
#elif TD_SERIAL_BAUD == 460800
#define UARTE_BAUD 0x075F7000u
#elif TD_SERIAL_BAUD == 921600
#define UARTE_BAUD 0x0F000000u
#elif TD_SERIAL_BAUD == 1000000
#define UARTE_BAUD 0x10000000u
#else
#error "port_nrf52840.c: TD_SERIAL_BAUD must be 115200, 230400, 460800, 921600 or 1000000"
#endif
#define PSEL(port, pin) (((uint32_t)(port) << 5) | (uint32_t)(pin))
#define PSEL_DISCONNECTED 0xFFFFFFFFu

/* GPIO P1 (TX pin as output, high when idle) */
#define P1_BASE 0x50000300u
#define P1_OUTSET REG(P1_BASE + 0x508u)
#define P1_PIN_CNF(n) REG(P1_BASE + 0x700u + 4u * (n))

/* TIMER1 */
#define TIMER1_BASE 0x40009000u
#define TIMER_TASKS_START REG(TIMER1_BASE + 0x000u)
#define TIMER_TASKS_STOP REG(TIMER1_BASE + 0x004u)
#define TIMER_TASKS_CLEAR REG(TIMER1_BASE + 0x00Cu)
#define TIMER_TASKS_CAPTURE0 REG(TIMER1_BASE + 0x040u)
#define TIMER_MODE REG(TIMER1_BASE + 0x504u)
#define TIMER_BITMODE REG(TIMER1_BASE + 0x508u)
#define TIMER_PRESCALER REG(TIMER1_BASE + 0x510u)
#define TIMER_CC0 REG(TIMER1_BASE + 0x540u)

#define SCB_AIRCR REG(0xE000ED0Cu)
#define DEMCR REG(0xE000EDFCu)              /* bit 24 TRCENA: enables the DWT */
#define DWT_CTRL REG(0xE0001000u)           /* bit 0 CYCCNTENA */
#define DWT_CYCCNT REG(0xE0001004u)

#define TX_PIN 3u    /* P1.03, Arduino D1 */
#define RX_PIN 10u   /* P1.10, Arduino D0 */
#define TICK_HZ 16000000u

uint32_t startup_stack_used(uint32_t *reserved);

static volatile uint8_t rx_buf[2];    /* EasyDMA needs RAM buffers */
static unsigned rx_next;              /* buffer the next completed byte lands in */
static volatile char tx_byte;
static uint32_t count_start;

void port_init(void)
{
    CLOCK_EVENTS_HFCLKSTARTED = 0u;
    CLOCK_TASKS_HFCLKSTART = 1u;
    while (!CLOCK_EVENTS_HFCLKSTARTED) {
    }

    P1_OUTSET = 1u << TX_PIN;
    P1_PIN_CNF(TX_PIN) = 1u;          /* output, input buffer disconnected */
    P1_PIN_CNF(RX_PIN) = 0u;          /* input */
    UARTE_ENABLE = 0u;
    UARTE_PSEL_TXD = PSEL(1, TX_PIN);
    UARTE_PSEL_RXD = PSEL(1, RX_PIN);
    UARTE_PSEL_RTS = PSEL_DISCONNECTED;
    UARTE_PSEL_CTS = PSEL_DISCONNECTED;
    UARTE_BAUDRATE = UARTE_BAUD;
    UARTE_CONFIG = 0u;                /* no parity, one stop bit, no flow control */
    UARTE_ENABLE = UARTE_ENABLE_ENABLED;

    /* Receive one byte at a time into rx_buf[0], then rx_buf[1], ... : after each RXSTARTED the
     * pointer is moved to the other buffer, so the hardware restart (ENDRX->STARTRX) fills it. */
    rx_next = 0;
    UARTE_RXD_PTR = (uint32_t)(uintptr_t)&rx_buf[0];
    UARTE_RXD_MAXCNT = 1u;
    UARTE_SHORTS = UARTE_SHORTS_ENDRX_STARTRX;
    UARTE_EVENTS_ENDRX = 0u;
    UARTE_EVENTS_RXSTARTED = 0u;
    UARTE_TASKS_STARTRX = 1u;

    TIMER_TASKS_STOP = 1u;
    TIMER_MODE = 0u;                  /* timer */
    TIMER_BITMODE = 3u;               /* 32 bit */
    TIMER_PRESCALER = 0u;             /* 16 MHz */
    TIMER_TASKS_CLEAR = 1u;
    TIMER_TASKS_START = 1u;

    DEMCR |= 1u << 24;
    DWT_CYCCNT = 0u;
    DWT_CTRL |= 1u;
}

void port_putc(char c)
{
    tx_byte = c;
    UARTE_EVENTS_ENDTX = 0u;
    UARTE_TXD_PTR = (uint32_t)(uintptr_t)&tx_byte;
    UARTE_TXD_MAXCNT = 1u;
    UARTE_TASKS_STARTTX = 1u;
    while (!UARTE_EVENTS_ENDTX) {
    }
    UARTE_TASKS_STOPTX = 1u;
}

int port_getc(void)
{
    int c;
    if (UARTE_EVENTS_RXSTARTED) {
        /* the transfer into rx_buf[rx_next] is running: point the next one at the other buffer */
        UARTE_EVENTS_RXSTARTED = 0u;
        UARTE_RXD_PTR = (uint32_t)(uintptr_t)&rx_buf[rx_next ^ 1u];
    }
    if (UARTE_EVENTS_ERROR) {
        UARTE_EVENTS_ERROR = 0u;
        UARTE_ERRORSRC = UARTE_ERRORSRC;  /* write 1 to clear */
    }
    if (!UARTE_EVENTS_ENDRX) {
        return -1;
    }
    UARTE_EVENTS_ENDRX = 0u;
    c = UARTE_RXD_AMOUNT ? (int)rx_buf[rx_next] : -1;
    rx_next ^= 1u;
    return c;
}

uint32_t port_ticks(void)
{
    TIMER_TASKS_CAPTURE0 = 1u;
    return TIMER_CC0;
}

uint32_t port_tick_hz(void)
{
    return TICK_HZ;
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
    SCB_AIRCR = 0x05FA0004u;          /* SYSRESETREQ: back to the bootloader / a fresh start */
    for (;;) {
    }
}
