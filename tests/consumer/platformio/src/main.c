/* Runs the packaged model kws on zero inputs and prints its outputs in hex over semihosting,
 * then "consumer: ok" (or what went wrong) and exits with the status. */
#include <stdint.h>
#include <string.h>
#include "kws_model.h"
#include "semihost.h"

static union {
    unsigned char bytes[KWS_ARENA_BYTES];
    double align_;
} arena;

int main(void)
{
    static char line[2 * 64 + 2];
    static const char hex[] = "0123456789abcdef";
    kws_ctx ctx;
    int i;
    size_t k, n = 0;
    if (kws_ctx_init(&ctx, arena.bytes, sizeof arena.bytes - 1) != KWS_ERR_ARENA_SIZE
        || kws_ctx_init(&ctx, arena.bytes, sizeof arena.bytes) != KWS_OK) {
        semihost_write0("consumer: arena refused\n");
        semihost_exit(3);
    }
    for (i = 0; i < KWS_NUM_INPUTS; ++i) {
        memset(kws_ctx_input(&ctx, i), 0, kws_input_bytes(i));
    }
    if (kws_ctx_run(&ctx) != KWS_OK) {
        semihost_write0("consumer: run refused\n");
        semihost_exit(3);
    }
    for (i = 0; i < KWS_NUM_OUTPUTS; ++i) {
        const unsigned char *o = kws_ctx_output(&ctx, i);
        for (k = 0; k < kws_output_bytes(i) && n + 2 < sizeof line - 1; ++k) {
            line[n++] = hex[o[k] >> 4];
            line[n++] = hex[o[k] & 15u];
        }
    }
    line[n++] = '\n';
    line[n] = '\0';
    semihost_write0("consumer: outputs ");
    semihost_write0(line);
    semihost_write0("consumer: ok\n");
    semihost_exit(0);
}
