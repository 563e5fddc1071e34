/*
 * tinydeploy's instruction counter: a QEMU TCG plugin (plugin API version 1: QEMU 7.2, as Debian 12
 * ships it; a QEMU whose minimum API version is higher says so when it refuses to load it) that counts the guest instructions a user-mode program executes, and among them the Advanced
 * SIMD / floating-point data-processing instructions and the lanes of fused multiply-adds
 * (AArch64 guests). Built by tinydeploy/runners/icount.py into tinydeploy's cache folder and loaded
 * with `qemu-aarch64 -plugin libtdcount.so,out=FILE[,run=ADDR,caller=LO-HI,...]`.
 *
 * Counting is per translation block: when a block is translated, its instructions are classified
 * once and an inline add of its three counts is attached, so executing it costs three additions.
 * Blocks that start at a marker address get a callback instead, which first reads the counters
 * (everything executed before the block) and then adds the block's own counts. With markers the
 * counts are split into windows:
 *
 *   run=ADDR      entry of the function that runs one inference (td_run): opens a run window
 *   caller=LO-HI  the function that calls it (main): its first block executed while a run window
 *                 is open closes the window (the inference has returned)
 *   lbegin=ADDR   entry of the per-layer hook called before a layer (td_profile_begin)
 *   lend=ADDR     entry of the hook called after it (td_profile_end)
 *   body=LO-HI    the function that calls the hooks (td_run): its first block executed after a
 *                 hook was entered ends the hook; after lbegin it also opens the layer's window
 *
 * A layer's window thus holds the caller's own instructions from the hook's return to the next
 * hook call plus everything the layer calls; the hooks themselves are left out of the layer and of
 * the run window (also a hook the body tail-calls, which returns straight to `caller`). Layers are
 * numbered by their order within a run.
 *
 * Counts are exact for a single-threaded guest: the inline additions are not atomic, so the report
 * says how many vCPUs (guest threads) ran. tinydeploy refuses its own code's counts when more than
 * one did; onnxruntime, which starts a second thread, is reported as a mean with its spread.
 *
 * At exit the plugin writes, to `out` (or through qemu_plugin_outs without it), lines of the form
 *   tdcount version 1
 *   vcpus N
 *   total INSNS SIMD_FP FMA_LANES
 *   windows N
 *   first INSNS SIMD_FP FMA_LANES          (the first run window)
 *   sum INSNS SIMD_FP FMA_LANES            (all run windows)
 *   steady MIN MAX                          (instructions of each run window after the first)
 *   layer K CALLS INSNS SIMD_FP FMA_LANES  (summed over all run windows)
 *
 * QEMU ships no header for the plugin API in Debian; the few declarations used are below, as QEMU's
 * docs/devel/tcg-plugins.rst documents them.
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the QEMU plugin API (version 1) used here --------------------------------------------- */
typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
struct qemu_plugin_insn;
/* qemu_info_t starts with the guest architecture's name; nothing else of it is read */
typedef struct qemu_info_t {
    const char *target_name;
} qemu_info_t;
enum qemu_plugin_cb_flags { QEMU_PLUGIN_CB_NO_REGS, QEMU_PLUGIN_CB_R_REGS, QEMU_PLUGIN_CB_RW_REGS };
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*qemu_plugin_vcpu_udata_cb_t)(unsigned int vcpu_index, void *userdata);
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);
typedef void (*qemu_plugin_vcpu_simple_cb_t)(qemu_plugin_id_t id, unsigned int vcpu_index);

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb *tb, qemu_plugin_vcpu_udata_cb_t cb,
                                          enum qemu_plugin_cb_flags flags, void *userdata);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op,
                                              void *ptr, uint64_t imm);
void qemu_plugin_register_vcpu_init_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_simple_cb_t cb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
uint64_t qemu_plugin_tb_vaddr(const struct qemu_plugin_tb *tb);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
const void *qemu_plugin_insn_data(const struct qemu_plugin_insn *insn);
size_t qemu_plugin_insn_size(const struct qemu_plugin_insn *insn);
void qemu_plugin_outs(const char *string);

#define EXPORT __attribute__((visibility("default")))
EXPORT int qemu_plugin_version = 1;
EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc, char **argv);

/* ---- counting ------------------------------------------------------------------------------- */
enum { INSNS, SIMD_FP, FMA_LANES, NCOUNT };
enum { ROLE_RUN = 1, ROLE_CALLER = 2, ROLE_LBEGIN = 4, ROLE_LEND = 8, ROLE_BODY = 16 };
#define MAX_LAYERS 65536

typedef struct {
    uint64_t n[NCOUNT];
    unsigned roles;
} Block;

static uint64_t count[NCOUNT];          /* everything executed so far */
static int aarch64;
static char *out_path;
static uint64_t run_at, lbegin_at, lend_at;
static uint64_t caller_lo, caller_hi, body_lo, body_hi;
static int have_run, have_caller, have_lbegin, have_lend, have_body;
static unsigned vcpus;

static int run_open;                    /* a run window is open */
static uint64_t run_start[NCOUNT], hooks_in_run[NCOUNT];
static uint64_t windows, first[NCOUNT], sum[NCOUNT], steady_min = UINT64_MAX, steady_max;
static int hook_open, layer_armed, layer_open;
static uint64_t hook_start[NCOUNT], layer_start[NCOUNT];
static unsigned layer_index, layers_seen;
static uint64_t (*layer_sum)[NCOUNT];
static uint64_t *layer_calls;

/* Lanes of an AArch64 fused multiply-add (FMLA, FMLS, FMADD, FMSUB, FNMADD, FNMSUB; vector, by
 * element and scalar), 0 for any other instruction. */
static unsigned fma_lanes(uint32_t w)
{
    const unsigned q = (w >> 30) & 1, sz = (w >> 22) & 1;
    const unsigned lanes = sz ? (q ? 2 : 1) : (q ? 4 : 2);       /* single or double precision */
    if ((w & 0xBF20FC00u) == 0x0E20CC00u || (w & 0xBF80B400u) == 0x0F801000u) {
        return lanes;                   /* vector FMLA/FMLS, single/double: same and by element */
    }
    if ((w & 0xBF60FC00u) == 0x0E400C00u || (w & 0xBFC0B400u) == 0x0F001000u) {
        return q ? 8 : 4;               /* vector FMLA/FMLS, half precision */
    }
    if ((w & 0xFF80B400u) == 0x5F801000u || (w & 0xFFC0B400u) == 0x5F001000u ||
        (w & 0xFF000000u) == 0x1F000000u) {
        return 1;                       /* scalar by element; FMADD and friends */
    }
    return 0;
}

/* Advanced SIMD and scalar floating-point data processing (the encoding group op0 = x111; loads
 * and stores of SIMD registers are not in it). */
static int is_simd_fp(uint32_t w)
{
    return (w & 0x0E000000u) == 0x0E000000u;
}

static void add(uint64_t *dst, const uint64_t *a, const uint64_t *b)  /* dst += a - b */
{
    int i;
    for (i = 0; i < NCOUNT; ++i) {
        dst[i] += a[i] - b[i];
    }
}

static void on_marker(unsigned vcpu_index, void *userdata)
{
    const Block *b = userdata;
    int i;
    (void)vcpu_index;
    if ((b->roles & ROLE_CALLER) && run_open) {         /* the inference returned */
        uint64_t w[NCOUNT] = {0};
        if (hook_open) {                /* a hook the caller tail-called returned straight here */
            add(hooks_in_run, count, hook_start);
        }
        add(w, count, run_start);
        for (i = 0; i < NCOUNT; ++i) {
            w[i] -= hooks_in_run[i];
            sum[i] += w[i];
            if (windows == 0) {
                first[i] = w[i];
            }
        }
        if (windows > 0) {
            steady_min = w[INSNS] < steady_min ? w[INSNS] : steady_min;
            steady_max = w[INSNS] > steady_max ? w[INSNS] : steady_max;
        }
        windows++;
        run_open = hook_open = layer_armed = layer_open = 0;
    }
    if ((b->roles & ROLE_RUN) && !run_open) {
        run_open = 1;
        memcpy(run_start, count, sizeof count);
        memset(hooks_in_run, 0, sizeof hooks_in_run);
        layer_index = 0;
    }
    if (run_open && (b->roles & ROLE_LEND)) {
        if (layer_open) {
            if (layer_index < MAX_LAYERS) {
                add(layer_sum[layer_index], count, layer_start);
                layer_calls[layer_index]++;
                layers_seen = layer_index + 1 > layers_seen ? layer_index + 1 : layers_seen;
            }
            layer_index++;
            layer_open = 0;
        }
    }
    if (run_open && (b->roles & (ROLE_LBEGIN | ROLE_LEND)) && !hook_open) {
        hook_open = 1;
        layer_armed = (b->roles & ROLE_LBEGIN) != 0;
        memcpy(hook_start, count, sizeof count);
    }
    if (run_open && (b->roles & ROLE_BODY) && hook_open) {      /* a hook returned */
        add(hooks_in_run, count, hook_start);
        hook_open = 0;
        if (layer_armed) {
            layer_armed = 0;
            layer_open = 1;
            memcpy(layer_start, count, sizeof count);
        }
    }
    for (i = 0; i < NCOUNT; ++i) {
        count[i] += b->n[i];
    }
}

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    const size_t n = qemu_plugin_tb_n_insns(tb);
    const uint64_t pc = qemu_plugin_tb_vaddr(tb);
    Block b = {{0, 0, 0}, 0};
    size_t i;
    (void)id;
    b.n[INSNS] = n;
    if (aarch64) {
        for (i = 0; i < n; ++i) {
            const struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);
            uint32_t w;
            if (qemu_plugin_insn_size(insn) != 4) {
                continue;
            }
            memcpy(&w, qemu_plugin_insn_data(insn), 4);      /* AArch64 code is little-endian */
            b.n[SIMD_FP] += (uint64_t)is_simd_fp(w);
            b.n[FMA_LANES] += fma_lanes(w);
        }
    }
    b.roles = (have_run && pc == run_at ? ROLE_RUN : 0u) |
              (have_caller && pc >= caller_lo && pc < caller_hi ? ROLE_CALLER : 0u) |
              (have_lbegin && pc == lbegin_at ? ROLE_LBEGIN : 0u) |
              (have_lend && pc == lend_at ? ROLE_LEND : 0u) |
              (have_body && pc >= body_lo && pc < body_hi ? ROLE_BODY : 0u);
    if (b.roles) {
        /* one per translation of a marked block: a few, kept for the program's life */
        Block *kept = malloc(sizeof *kept);
        if (kept == NULL) {
            abort();
        }
        *kept = b;
        qemu_plugin_register_vcpu_tb_exec_cb(tb, on_marker, QEMU_PLUGIN_CB_NO_REGS, kept);
        return;
    }
    for (i = 0; i < NCOUNT; ++i) {
        if (b.n[i]) {
            qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &count[i], b.n[i]);
        }
    }
}

static void on_vcpu_init(qemu_plugin_id_t id, unsigned int vcpu_index)
{
    (void)id;
    (void)vcpu_index;
    vcpus++;
}

static void report(qemu_plugin_id_t id, void *userdata)
{
    char line[160];
    FILE *f = out_path ? fopen(out_path, "w") : NULL;
    unsigned k;
    (void)id;
    (void)userdata;
#define EMIT(...)                                                                                  \
    do {                                                                                           \
        snprintf(line, sizeof line, __VA_ARGS__);                                                  \
        if (f) {                                                                                   \
            fputs(line, f);                                                                        \
        } else {                                                                                   \
            qemu_plugin_outs(line);                                                                \
        }                                                                                          \
    } while (0)
    EMIT("tdcount version 1\n");
    EMIT("vcpus %u\n", vcpus);
    EMIT("total %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", count[0], count[1], count[2]);
    EMIT("windows %" PRIu64 "\n", windows);
    if (windows) {
        EMIT("first %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", first[0], first[1], first[2]);
        EMIT("sum %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", sum[0], sum[1], sum[2]);
    }
    if (windows > 1) {
        EMIT("steady %" PRIu64 " %" PRIu64 "\n", steady_min, steady_max);
    }
    for (k = 0; k < layers_seen; ++k) {
        EMIT("layer %u %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", k, layer_calls[k],
             layer_sum[k][0], layer_sum[k][1], layer_sum[k][2]);
    }
    EMIT("end\n");
#undef EMIT
    if (f) {
        fclose(f);
    }
}

/* "0x1234" -> value; 0 when the text is not a whole hexadecimal number */
static int parse_hex(const char *s, uint64_t *v)
{
    char *end;
    if (strncmp(s, "0x", 2) != 0 || s[2] == '\0') {
        return 0;
    }
    *v = strtoull(s + 2, &end, 16);
    return *end == '\0';
}

static int parse_range(const char *s, uint64_t *lo, uint64_t *hi)
{
    char buf[64];
    const char *dash = strchr(s, '-');
    if (dash == NULL || (size_t)(dash - s) >= sizeof buf) {
        return 0;
    }
    memcpy(buf, s, (size_t)(dash - s));
    buf[dash - s] = '\0';
    return parse_hex(buf, lo) && parse_hex(dash + 1, hi) && *lo < *hi;
}

EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc, char **argv)
{
    int i;
    for (i = 0; i < argc; ++i) {
        const char *a = argv[i];
        int ok;
        if (strncmp(a, "out=", 4) == 0) {
            out_path = strdup(a + 4);
            ok = out_path != NULL;
        } else if (strncmp(a, "run=", 4) == 0) {
            ok = have_run = parse_hex(a + 4, &run_at);
        } else if (strncmp(a, "caller=", 7) == 0) {
            ok = have_caller = parse_range(a + 7, &caller_lo, &caller_hi);
        } else if (strncmp(a, "lbegin=", 7) == 0) {
            ok = have_lbegin = parse_hex(a + 7, &lbegin_at);
        } else if (strncmp(a, "lend=", 5) == 0) {
            ok = have_lend = parse_hex(a + 5, &lend_at);
        } else if (strncmp(a, "body=", 5) == 0) {
            ok = have_body = parse_range(a + 5, &body_lo, &body_hi);
        } else {
            ok = 0;
        }
        if (!ok) {
            fprintf(stderr, "tdcount: bad plugin argument '%s'\n", a);
            return -1;
        }
    }
    aarch64 = info != NULL && info->target_name != NULL && strcmp(info->target_name, "aarch64") == 0;
    layer_sum = calloc(MAX_LAYERS, sizeof *layer_sum);
    layer_calls = calloc(MAX_LAYERS, sizeof *layer_calls);
    if (layer_sum == NULL || layer_calls == NULL) {
        return -1;
    }
    qemu_plugin_register_vcpu_init_cb(id, on_vcpu_init);
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, report, NULL);
    return 0;
}
