/* port_arduino.cpp: the port layer over the Arduino core (any board it supports, e.g. the
 * Nano 33 BLE with the Arduino Mbed OS core): USB Serial and micros(). The harness's main() is
 * left out when ARDUINO is defined; the sketch's setup()/loop() below drive it instead.
 * Not built by tinydeploy's CI (the Arduino core cannot be installed offline). */
#include <Arduino.h>
#include "port.h"
#include "harness.h"
#include "harness_config.h"

#ifndef TD_SERIAL_BAUD
#define TD_SERIAL_BAUD 115200
#endif

static uint32_t count_start;

extern "C" {

void port_init(void)
{
    Serial.begin(TD_SERIAL_BAUD);
    while (!Serial) {
        /* USB CDC: wait for the host to open the port, so the boot banner is not lost */
    }
}

void port_putc(char c)
{
    Serial.write((uint8_t)c);
}

int port_getc(void)
{
    return Serial.available() > 0 ? Serial.read() : -1;
}

uint32_t port_ticks(void)
{
    return (uint32_t)micros();
}

uint32_t port_tick_hz(void)
{
    return 1000000u;
}

uint32_t port_us(void)
{
    return (uint32_t)micros();
}

void port_count_begin(void)
{
    count_start = port_ticks();
}

uint32_t port_count_end(void)
{
    return port_ticks() - count_start;
}

const char *port_count_unit(void)
{
    return "ticks";
}

uint32_t port_stack_used(uint32_t *reserved)
{
    *reserved = 0;
    return 0;
}

void port_exit(int code)
{
    (void)code;
    Serial.flush();
    for (;;) {
    }
}

} /* extern "C" */

void setup()
{
    harness_init();
}

void loop()
{
    harness_poll();
}
