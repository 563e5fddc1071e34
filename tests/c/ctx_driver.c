/* A test program of the library form's API (tinydeploy build --name NAME), written against
 * NAME_model.h and nothing else. Compile it with the model's sources and
 *   -DTD_HEADER='"NAME_model.h"' -DTD_NAME=NAME -DTD_NAME_UPPER=NAME_IN_CAPITALS
 * Modes:
 *   ctx_driver arena               the context checks: a too-small or misaligned arena, a NULL
 *                                  context and a run on a refused context each give their error
 *                                  code ("check <what> <code>" lines); exit 0 when all are right
 *   ctx_driver steps N IN OUT      one context on an arena of its own: N runs, input bytes of run k
 *                                  at IN[k * inputs]; after each run OUT gets its outputs, then its
 *                                  states (NAME_ctx_state); then NAME_ctx_reset_state and run 0
 *                                  again: its outputs are appended once more
 *   ctx_driver threads T R IN OUT  T threads, each with its context and arena, R runs each on the
 *                                  same inputs (IN), while the main thread has run them once
 *                                  serially: every threaded result must equal the serial one
 *                                  (exit 1 if not); OUT gets the serial outputs
 * Exit status: 0 ok, 1 a check failed, 2 bad usage or files. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include TD_HEADER

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define API(f) CAT(TD_NAME, CAT(_, f))
#define MACRO(m) CAT(TD_NAME_UPPER, CAT(_, m))
typedef API(ctx) ctx_t;

#define ARENA_BYTES ((size_t)MACRO(ARENA_BYTES))
#define ALIGN ((size_t)MACRO(ARENA_ALIGN))
#define MAX_THREADS 8

static size_t total(size_t (*bytes)(int), int n)
{
    size_t t = 0;
    int i;
    for (i = 0; i < n; ++i) {
        t += bytes(i);
    }
    return t;
}

/* An arena of `bytes` starting at a multiple of ALIGN plus `offset` (freed with free(*base)). */
static unsigned char *arena_at(size_t bytes, size_t offset, void **base)
{
    unsigned char *p;
    if (posix_memalign(base, ALIGN < sizeof(void *) ? sizeof(void *) : ALIGN, bytes + offset + 1) != 0) {
        return NULL;
    }
    p = (unsigned char *)*base + offset;
    return p;
}

static unsigned char *read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    unsigned char *buf;
    long len;
    if (!f || fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        return NULL;
    }
    buf = malloc((size_t)len + 1);
    if (buf && fread(buf, 1, (size_t)len, f) != (size_t)len) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *n = (size_t)len;
    return buf;
}

static void set_inputs(ctx_t *c, const unsigned char *p)
{
    int i;
    for (i = 0; i < MACRO(NUM_INPUTS); ++i) {
        memcpy(API(ctx_input)(c, i), p, API(input_bytes)(i));
        p += API(input_bytes)(i);
    }
}

static void get_outputs(const ctx_t *c, unsigned char *p)
{
    int i;
    for (i = 0; i < MACRO(NUM_OUTPUTS); ++i) {
        memcpy(p, API(ctx_output)(c, i), API(output_bytes)(i));
        p += API(output_bytes)(i);
    }
}

static int check(const char *what, int got, int want)
{
    printf("check %s %d\n", what, got);
    if (got != want) {
        fprintf(stderr, "%s: got %d, want %d\n", what, got, want);
        return 1;
    }
    return 0;
}

static int mode_arena(void)
{
    ctx_t c;
    void *base;
    unsigned char *ok = arena_at(ARENA_BYTES, 0, &base);
    int bad = 0;
    if (!ok) {
        return 2;
    }
    memset(&c, 0, sizeof c);
    bad |= check("run_zeroed_context", API(ctx_run)(&c), MACRO(ERR_NOT_READY));
    bad |= check("null_context", API(ctx_init)(NULL, ok, ARENA_BYTES), MACRO(ERR_ARGUMENT));
    bad |= check("too_small", API(ctx_init)(&c, ok, ARENA_BYTES - 1), MACRO(ERR_ARENA_SIZE));
    bad |= check("run_after_refusal", API(ctx_run)(&c), MACRO(ERR_NOT_READY));
    bad |= check("input_after_refusal", API(ctx_input)(&c, 0) == NULL, 1);
    if (ALIGN > 1) {
        void *base2;
        unsigned char *off = arena_at(ARENA_BYTES, 1, &base2);
        bad |= check("misaligned", API(ctx_init)(&c, off, ARENA_BYTES), MACRO(ERR_ARENA_ALIGN));
        free(base2);
    }
    bad |= check("exact_size", API(ctx_init)(&c, ok, ARENA_BYTES), MACRO(OK));
    memset(ok, 0, ARENA_BYTES);
    bad |= check("run", API(ctx_run)(&c), MACRO(OK));
    bad |= check("input_out_of_range", API(ctx_input)(&c, MACRO(NUM_INPUTS)) == NULL, 1);
    free(base);
    return bad;
}

static int mode_steps(int n, const char *in_path, const char *out_path)
{
    const size_t in_bytes = total(API(input_bytes), MACRO(NUM_INPUTS));
    const size_t out_bytes = total(API(output_bytes), MACRO(NUM_OUTPUTS));
    size_t len, k;
    unsigned char *in = read_file(in_path, &len), *out;
    void *base;
    unsigned char *arena = arena_at(ARENA_BYTES, 0, &base);
    FILE *f;
    ctx_t c;
    if (!in || !arena || len != in_bytes * (size_t)n || API(ctx_init)(&c, arena, ARENA_BYTES) != MACRO(OK)) {
        fprintf(stderr, "steps: bad input file or arena\n");
        return 2;
    }
    out = malloc(out_bytes + 1);
    f = fopen(out_path, "wb");
    if (!out || !f) {
        return 2;
    }
    for (k = 0; k <= (size_t)n; ++k) {
        const size_t step = k < (size_t)n ? k : 0;
        if (k == (size_t)n) {
            API(ctx_reset_state)(&c);
        }
        set_inputs(&c, in + step * in_bytes);
        if (API(ctx_run)(&c) != MACRO(OK)) {
            return 1;
        }
        get_outputs(&c, out);
        fwrite(out, 1, out_bytes, f);
        if (k < (size_t)n) {
            int i;
            for (i = 0; i < MACRO(NUM_STATES); ++i) {
                fwrite(API(ctx_state)(&c, i), 1, API(state_bytes)(i), f);
            }
        }
    }
    fclose(f);
    free(out);
    free(in);
    free(base);
    return 0;
}

struct job {
    const unsigned char *in;
    const unsigned char *want;
    int runs;
    int mismatches;
};

static void *worker(void *arg)
{
    struct job *j = arg;
    const size_t out_bytes = total(API(output_bytes), MACRO(NUM_OUTPUTS));
    void *base;
    unsigned char *arena = arena_at(ARENA_BYTES, 0, &base), *out = malloc(out_bytes + 1);
    ctx_t c;
    int r;
    if (!arena || !out || API(ctx_init)(&c, arena, ARENA_BYTES) != MACRO(OK)) {
        j->mismatches = -1;
        return NULL;
    }
    for (r = 0; r < j->runs; ++r) {
        set_inputs(&c, j->in);
        (void)API(ctx_run)(&c);
        get_outputs(&c, out);
        j->mismatches += memcmp(out, j->want, out_bytes) != 0;
    }
    free(out);
    free(base);
    return NULL;
}

static int mode_threads(int t, int runs, const char *in_path, const char *out_path)
{
    const size_t in_bytes = total(API(input_bytes), MACRO(NUM_INPUTS));
    const size_t out_bytes = total(API(output_bytes), MACRO(NUM_OUTPUTS));
    size_t len;
    unsigned char *in = read_file(in_path, &len), *want = malloc(out_bytes + 1);
    void *base;
    unsigned char *arena = arena_at(ARENA_BYTES, 0, &base);
    pthread_t th[MAX_THREADS];
    struct job jobs[MAX_THREADS];
    ctx_t c;
    FILE *f;
    int i, bad = 0;
    if (!in || !want || !arena || len != in_bytes || t < 1 || t > MAX_THREADS
        || API(ctx_init)(&c, arena, ARENA_BYTES) != MACRO(OK)) {
        fprintf(stderr, "threads: bad arguments\n");
        return 2;
    }
    set_inputs(&c, in);             /* the serial run */
    (void)API(ctx_run)(&c);
    get_outputs(&c, want);
    for (i = 0; i < t; ++i) {
        jobs[i].in = in;
        jobs[i].want = want;
        jobs[i].runs = runs;
        jobs[i].mismatches = 0;
        if (pthread_create(&th[i], NULL, worker, &jobs[i]) != 0) {
            return 2;
        }
    }
    for (i = 0; i < t; ++i) {
        pthread_join(th[i], NULL);
        printf("thread %d mismatches %d\n", i, jobs[i].mismatches);
        bad |= jobs[i].mismatches != 0;
    }
    f = fopen(out_path, "wb");
    if (!f || fwrite(want, 1, out_bytes, f) != out_bytes) {
        return 2;
    }
    fclose(f);
    free(in);
    free(want);
    free(base);
    return bad;
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "arena")) {
        return mode_arena();
    }
    if (argc == 5 && !strcmp(argv[1], "steps")) {
        return mode_steps(atoi(argv[2]), argv[3], argv[4]);
    }
    if (argc == 6 && !strcmp(argv[1], "threads")) {
        return mode_threads(atoi(argv[2]), atoi(argv[3]), argv[4], argv[5]);
    }
    fprintf(stderr, "usage: %s arena | steps N IN OUT | threads T R IN OUT\n", argv[0]);
    return 2;
}
