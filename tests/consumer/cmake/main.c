/* consumer IN.bin OUT.bin: runs the packaged model kws once on an arena of its own.
 * Exit status: 0 ok, 2 bad files, 3 the model refused the arena or the run. */
#include <stdint.h>
#include <stdio.h>
#include "kws_model.h"

static union {
    unsigned char bytes[KWS_ARENA_BYTES + KWS_ARENA_ALIGN];
    double align_;
} arena;

int main(int argc, char **argv)
{
    kws_ctx ctx;
    unsigned char *a = arena.bytes + (KWS_ARENA_ALIGN - (uintptr_t)arena.bytes % KWS_ARENA_ALIGN) % KWS_ARENA_ALIGN;
    FILE *f;
    int i;
    if (argc != 3) {
        fprintf(stderr, "usage: %s IN.bin OUT.bin\n", argv[0]);
        return 2;
    }
    if (kws_ctx_init(&ctx, a, KWS_ARENA_BYTES - 1) != KWS_ERR_ARENA_SIZE
        || kws_ctx_init(&ctx, a, KWS_ARENA_BYTES) != KWS_OK) {
        return 3;
    }
    f = fopen(argv[1], "rb");
    if (!f) {
        return 2;
    }
    for (i = 0; i < KWS_NUM_INPUTS; ++i) {
        if (fread(kws_ctx_input(&ctx, i), 1, kws_input_bytes(i), f) != kws_input_bytes(i)) {
            return 2;
        }
    }
    fclose(f);
    if (kws_ctx_run(&ctx) != KWS_OK) {
        return 3;
    }
    f = fopen(argv[2], "wb");
    if (!f) {
        return 2;
    }
    for (i = 0; i < KWS_NUM_OUTPUTS; ++i) {
        fwrite(kws_ctx_output(&ctx, i), 1, kws_output_bytes(i), f);
    }
    return fclose(f) != 0 ? 2 : 0;
}
