/* harness.h: entry points of the portable protocol harness (harness.c). Bare-metal builds use the
 * main() in harness.c; an Arduino sketch calls harness_init() from setup() and harness_poll()
 * from loop(). */
#ifndef TD_HARNESS_H
#define TD_HARNESS_H

#ifdef __cplusplus
extern "C" {
#endif

void harness_init(void);        /* port_init(), then the boot banner */
void harness_poll(void);        /* reads at most one byte and acts on it */
void harness_feed(int c);       /* acts on one received byte */

#ifdef __cplusplus
}
#endif
#endif /* TD_HARNESS_H */
