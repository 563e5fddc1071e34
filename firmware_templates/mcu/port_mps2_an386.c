/* port_mps2_an386.c: Arm MPS2 AN386 (Cortex-M4) as QEMU models it (-M mps2-an386).
 * Serial: CMSDK APB UART0 at 0x40004000. Ticks: CMSDK APB timer0 at 0x40000000, a 32-bit down
 * counter at 25 MHz. With QEMU's -icount shift=0 one tick is exactly 40 executed instructions.
 * Exit: Arm semihosting SYS_EXIT_EXTENDED (QEMU needs -semihosting-config enable=on). */
#include <stdint.h>
#include "port.h"

#define REG(addr) (*(volatile uint32_t *)(addr))
#define UART0_DATA REG(0x40004000u)
#define UART0_STATE REG(0x40004004u)      /* bit0 TX full, bit1 RX full */
#define UART0_CTRL REG(0x40004008u)       /* bit0 TX enable, bit1 RX enable */
#define UART0_BAUDDIV REG(0x40004010u)
#define TIMER0_CTRL REG(0x40000000u)      /* bit0 enable */
#define TIMER0_VALUE REG(0x40000004u)
#define TIMER0_RELOAD REG(0x40000008u)
#define TICK_HZ 25000000u

uint32_t startup_stack_used(uint32_t *reserved);

static uint32_t us_last_ticks, us_acc, us_rem;

void port_init(void)
{
    UART0_BAUDDIV = 16u;
    UART0_CTRL = 3u;
    TIMER0_CTRL = 0u;
    TIMER0_RELOAD = 0xFFFFFFFFu;
    TIMER0_VALUE = 0xFFFFFFFFu;
    TIMER0_CTRL = 1u;
    us_last_ticks = port_ticks();
}

void port_putc(char c)
{
    while (UART0_STATE & 1u) {
    }
    UART0_DATA = (uint32_t)(unsigned char)c;
}

int port_getc(void)
{
    return (UART0_STATE & 2u) ? (int)(UART0_DATA & 0xFFu) : -1;
}

uint32_t port_ticks(void)
{
    return 0xFFFFFFFFu - TIMER0_VALUE;
}

uint32_t port_tick_hz(void)
{
    return TICK_HZ;
}

/* Microseconds, kept exact across tick wrap-around as long as it is called every 171 s. */
uint32_t port_us(void)
{
    const uint32_t now = port_ticks();
    const uint32_t elapsed = now - us_last_ticks + us_rem;
    us_last_ticks = now;
    us_acc += elapsed / (TICK_HZ / 1000000u);
    us_rem = elapsed % (TICK_HZ / 1000000u);
    return us_acc;
}

uint32_t port_stack_used(uint32_t *reserved)
{
    return startup_stack_used(reserved);
}

void port_exit(int code)
{
    /* SYS_EXIT_EXTENDED (0x20) with {ADP_Stopped_ApplicationExit, code}: QEMU exits with code. */
    static uint32_t block[2];
    register uint32_t r0 __asm__("r0") = 0x20u;
    register uint32_t *r1 __asm__("r1") = block;
    block[0] = 0x20026u;
    block[1] = (uint32_t)code;
    __asm__ volatile("bkpt 0xab" : "+r"(r0) : "r"(r1) : "memory");
    for (;;) {
    }
}
