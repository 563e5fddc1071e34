/* port_mps2.c: the Arm MPS2 FPGA boards as QEMU models them (-M mps2-an386: Cortex-M4,
 * -M mps2-an500: Cortex-M7), which share one peripheral map.
 * Serial: CMSDK APB UART0 at 0x40004000. Ticks: CMSDK APB timer0 at 0x40000000, a 32-bit down
 * counter at 25 MHz. With QEMU's -icount shift=0 one tick is exactly 40 executed instructions.
 * Exit: Arm semihosting SYS_EXIT_EXTENDED (QEMU needs -semihosting-config enable=on).
 * Timestamps: port_us() counts microseconds of the emulated board's clock (TD_US_CLOCK_HZ in
 * harness_config.h), one instruction per cycle, so m-lap-us-N agrees with the instruction counts
 * converted at the board's clock (what `tinydeploy run` reports) and not with QEMU's 1 GHz. */
#include <stdint.h>
#include "port.h"
#include "harness_config.h"
#ifndef TD_US_CLOCK_HZ
#define TD_US_CLOCK_HZ TICK_HZ
#endif

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

static uint32_t count_start, count_calibration;

void port_init(void)
{
    UART0_BAUDDIV = 16u;
    UART0_CTRL = 3u;
    /* Reading DATA makes QEMU look at the host side of the serial port again: it may have asked
     * before RX was enabled, got "not ready", and would otherwise wait for an unrelated event. */
    (void)UART0_DATA;
    TIMER0_CTRL = 0u;
    TIMER0_RELOAD = 0xFFFFFFFFu;
    TIMER0_VALUE = 0xFFFFFFFFu;
    TIMER0_CTRL = 1u;
    port_count_begin();
    count_calibration = port_count_end();   /* an empty measurement counts 0 */
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

/* Instructions since port_init() (40 per tick, exact under -icount shift=0) at TD_US_CLOCK_HZ
 * instructions per second; exact across tick wrap-around as long as it is called at least once
 * per counter period (2^32 ticks). */
uint32_t port_us(void)
{
    static uint32_t last;
    static uint64_t instructions;
    const uint32_t now = port_ticks();
    instructions += (uint64_t)(now - last) * (1000000000u / TICK_HZ);
    last = now;
    return (uint32_t)(instructions * 1000000u / TD_US_CLOCK_HZ);
}

/* Exact instruction counts under QEMU -icount shift=0, where the 25 MHz timer advances exactly
 * every 40 instructions. td_align() waits for a timer edge with a 4-instruction loop, then finds
 * where in that loop the edge fell (d = 0..3 instructions late) by reading the timer exactly 38
 * and 77..79 instructions later across the next two edges, and ends at a fixed 85 instructions
 * after the edge on every path. Its own entry point in instructions is then
 * 40 * ticks_at_edge + d - 4 * loop_iterations and its exit 40 * ticks_at_edge (+ constants), so
 * the distance from one td_align()'s exit to the next one's entry is exact to the instruction,
 * whatever the phase of the timer (tests/test_mcu.py checks it at every phase). Every instruction
 * below counts 1 for QEMU, branch taken or not: the counts are the layout, do not edit casually. */
__attribute__((noinline)) static uint32_t td_align(uint32_t *exit_stamp)
{
    uint32_t v0, v, k, a, d;   /* v0 is reused for the second-level reads */
    const volatile uint32_t *t = &TIMER0_VALUE;
    __asm__ volatile(
        "movs %[k], #0\n\t"
        "ldr %[v0], [%[t]]\n"
        "1:\n\t"
        "ldr %[v], [%[t]]\n\t"
        "adds %[k], %[k], #1\n\t"
        "cmp %[v], %[v0]\n\t"
        "beq 1b\n\t"
        ".rept 34\n\tnop\n\t.endr\n\t"
        "ldr %[a], [%[t]]\n\t"              /* edge + d + 38: changed iff d >= 2 */
        "cmp %[a], %[v]\n\t"
        "bne 3f\n\t"
        "subs %[a], %[a], #1\n\t"          /* the value after edge + 40 (a down counter) */
        ".rept 37\n\tnop\n\t.endr\n\t"
        "ldr %[v0], [%[t]]\n\t"              /* edge + d + 79: past edge + 80 iff d >= 1 */
        "cmp %[v0], %[a]\n\t"
        "bne 2f\n\t"
        "movs %[d], #0\n\t"
        "nop\n\t"
        "b 9f\n"
        "2:\n\t"
        "movs %[d], #1\n\t"
        "b 9f\n"
        "3:\n\t"
        ".rept 36\n\tnop\n\t.endr\n\t"
        "ldr %[v0], [%[t]]\n\t"              /* edge + d + 77: past edge + 80 iff d >= 3 */
        "cmp %[v0], %[a]\n\t"
        "bne 4f\n\t"
        "movs %[d], #2\n\t"
        "nop\n\t"
        "b 9f\n"
        "4:\n\t"
        "movs %[d], #3\n\t"
        "nop\n"
        "9:\n"
        : [v0] "=&l"(v0), [v] "=&l"(v), [k] "=&l"(k), [a] "=&l"(a), [d] "=&l"(d)
        : [t] "l"(t)
        : "cc", "memory");
    (void)v0;
    *exit_stamp = 40u * (0xFFFFFFFFu - v);     /* exit: edge + 85 (+ the constant return path) */
    return 40u * (0xFFFFFFFFu - v) + d - 4u * k;   /* entry: edge + d - 4 k (+ a constant) */
}

void port_count_begin(void)
{
    (void)td_align(&count_start);
}

uint32_t port_count_end(void)
{
    uint32_t exit_stamp;
    return td_align(&exit_stamp) - count_start - count_calibration;
}

const char *port_count_unit(void)
{
    return "instructions";
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
