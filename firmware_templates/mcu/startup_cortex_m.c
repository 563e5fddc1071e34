/* startup_cortex_m.c: vector table and reset for any Cortex-M3/M4/M7 board, bare metal.
 * Reset enables the FPU (when built for one), copies .data from flash, zeroes .bss, paints the
 * unused stack so port_stack_used() can measure its high-water mark, then calls main().
 * Symbols come from the generated linker script (link.ld). No interrupts are used. */
#include <stdint.h>
#include "port.h"

extern uint32_t __data_load[], __data_start[], __data_end[], __bss_start[], __bss_end[];
extern uint32_t __stack_bottom[], __stack_top[];
int main(void);

#define TD_STACK_PAINT 0xA5A5A5A5u
#define SCB_VTOR (*(volatile uint32_t *)0xE000ED08u)
#define SCB_CPACR (*(volatile uint32_t *)0xE000ED88u)

void Reset_Handler(void);
void Fault_Handler(void);
void Default_Handler(void);

struct vector_table {
    uint32_t *initial_sp;
    void (*handler[15])(void);
};

__attribute__((section(".isr_vector"), used))
const struct vector_table td_vectors = {
    __stack_top,
    {
        Reset_Handler,   /* reset */
        Fault_Handler,   /* NMI */
        Fault_Handler,   /* HardFault */
        Fault_Handler,   /* MemManage */
        Fault_Handler,   /* BusFault */
        Fault_Handler,   /* UsageFault */
        0, 0, 0, 0,      /* reserved */
        Default_Handler, /* SVCall */
        Default_Handler, /* DebugMonitor */
        0,               /* reserved */
        Default_Handler, /* PendSV */
        Default_Handler, /* SysTick */
    },
};

void Reset_Handler(void)
{
    uint32_t *p, *q, *sp;
#if defined(__ARM_FP)
    SCB_CPACR |= 0xFu << 20;            /* CP10, CP11: full access */
    __asm__ volatile("dsb\n\tisb" ::: "memory");
#endif
    SCB_VTOR = (uint32_t)(uintptr_t)&td_vectors;   /* also right behind a bootloader */
    for (p = __data_start, q = __data_load; p < __data_end;) {
        *p++ = *q++;
    }
    for (p = __bss_start; p < __bss_end;) {
        *p++ = 0;
    }
    __asm__ volatile("mov %0, sp" : "=r"(sp));
    for (p = __stack_bottom; p < sp - 16;) {
        *p++ = TD_STACK_PAINT;
    }
    (void)main();
    port_exit(0);
    for (;;) {
    }
}

/* Most stack bytes used since reset: the lowest word no longer holding the paint. */
uint32_t startup_stack_used(uint32_t *reserved)
{
    const uint32_t *p = __stack_bottom;
    while (p < __stack_top && *p == TD_STACK_PAINT) {
        ++p;
    }
    *reserved = (uint32_t)((uintptr_t)__stack_top - (uintptr_t)__stack_bottom);
    return (uint32_t)((uintptr_t)__stack_top - (uintptr_t)p);
}

static void fault_line(const char *s)
{
    while (*s) {
        port_putc(*s++);
    }
}

void Fault_Handler(void)
{
    fault_line("\r\ne-[fault: the firmware crashed (hard fault); stopping]\r\n");
    port_exit(3);
    for (;;) {
    }
}

void Default_Handler(void)
{
    fault_line("\r\ne-[unexpected interrupt; stopping]\r\n");
    port_exit(4);
    for (;;) {
    }
}
