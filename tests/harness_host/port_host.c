/* port_host.c: the firmware harness's port (firmware_templates/mcu/port.h) on a POSIX host, for
 * tests that run harness.c natively under AddressSanitizer and UBSan: the serial port is stdin
 * and stdout (stdin polled with a 1 ms wait, so the harness still sees "no byte"), the end of
 * stdin ends the program, and the ticks are CLOCK_MONOTONIC microseconds. TD_TICK_STEP (an
 * environment variable, default 0) is added to the tick counter after every measured run, so a
 * test can make runs look as long as it likes (sums past 2^32 ticks). */
#define _POSIX_C_SOURCE 200809L
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include "port.h"

static uint64_t skew, step;

static uint64_t now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000u + (uint64_t)t.tv_nsec / 1000u;
}

void port_init(void)
{
    const char *s = getenv("TD_TICK_STEP");
    step = s ? strtoull(s, NULL, 0) : 0u;
}

void port_putc(char c)
{
    putchar(c);
    if (c == '\n') {
        fflush(stdout);
    }
}

int port_getc(void)
{
    struct pollfd p;
    unsigned char b;
    ssize_t n;
    p.fd = 0;
    p.events = POLLIN;
    p.revents = 0;
    if (poll(&p, 1, 1) <= 0) {
        return -1;
    }
    n = read(0, &b, 1);
    if (n == 1) {
        return b;
    }
    if (n == 0) {
        fflush(stdout);
        exit(0);
    }
    return -1;
}

uint32_t port_ticks(void)
{
    return (uint32_t)(now_us() + skew);
}

uint32_t port_tick_hz(void)
{
    return 1000000u;
}

uint32_t port_us(void)
{
    return (uint32_t)now_us();
}

void port_count_begin(void)
{
}

uint32_t port_count_end(void)
{
    skew += step;
    return 1u;
}

const char *port_count_unit(void)
{
    return "ticks";
}

uint32_t port_stack_used(uint32_t *reserved)
{
    *reserved = 0u;
    return 0u;
}

void port_exit(int code)
{
    fflush(stdout);
    exit(code);
}
