/* port.h: what the harness needs from a board. Everything else in the firmware is portable C99.
 * A port is one small file (port_<board>.c): a serial port, a free-running tick counter, init and
 * exit. The harness polls port_getc(), so no interrupts are needed. */
#ifndef TD_PORT_H
#define TD_PORT_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Clocks, serial port (115200 8N1 unless the board says otherwise) and tick counter. */
void port_init(void);
/* Sends one byte; blocks until the transmitter accepts it. */
void port_putc(char c);
/* One received byte (0..255), or -1 when none is waiting. Never blocks. */
int port_getc(void);
/* Free-running counter; wraps at 2^32. port_tick_hz() says how fast it counts. */
uint32_t port_ticks(void);
uint32_t port_tick_hz(void);
/* Microseconds since port_init(); wraps at 2^32. */
uint32_t port_us(void);
/* For ports that only have a tick counter (their port_us() returns this): microseconds from
 * port_ticks() and port_tick_hz() >= 1 MHz, exact across tick wrap-around as long as it is called
 * at least once per counter period. Static inline: each port keeps its own state. */
static inline uint32_t port_us_from_ticks(void)
{
    static uint32_t last_ticks, us, rem;
    const uint32_t per_us = port_tick_hz() / 1000000u;
    const uint32_t now = port_ticks();
    const uint32_t elapsed = now - last_ticks + rem;
    last_ticks = now;
    us += elapsed / per_us;
    rem = elapsed % per_us;
    return us;
}
/* Work counter around td_run(): port_count_begin(), the code to measure, port_count_end() returns
 * the count in port_count_unit() units ("instructions" when exact, e.g. under QEMU -icount
 * shift=0; "ticks" of port_ticks() otherwise). One measurement at a time. */
void port_count_begin(void);
uint32_t port_count_end(void);
const char *port_count_unit(void);
/* Most stack bytes ever used since reset and the bytes reserved (0, 0 when unknown). */
uint32_t port_stack_used(uint32_t *reserved);
/* Ends the program: exit code to an emulator, reset or halt on a real board. */
void port_exit(int code);

#ifdef __cplusplus
}
#endif
#endif /* TD_PORT_H */
