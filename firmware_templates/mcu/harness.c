/* harness.c: the device side of the MLPerf Tiny (EEMBC EnergyRunner) serial protocol, performance
 * mode, plus tinydeploy's extensions. Portable C99, the same for every board; the board's
 * port_<board>.c supplies the serial port and the tick counter (see port.h).
 *
 * Commands end with '%' (at most 80 characters before it; '\r' and '\n' are ignored). Every reply
 * ends with the line "m-ready"; errors are "e-[...]" lines and the device keeps serving.
 *   name%              m-name-dut-[<name>]
 *   profile%           m-profile-[ULPMark for tinyML Firmware V0.0.1], m-model-[<id>]
 *   timestamp%         m-lap-us-<u32>
 *   db load N%         m-[Expecting N bytes]; then db <hex>% chunks until m-load-done (with
 *                      TD_DB_SUBTRACT_128, each byte is taken as uint8 and stored as int8 v - 128;
 *                      with TD_DB_FLOAT32 the bytes are little-endian float32 values, N a multiple
 *                      of 4, each quantised into the input as QuantizeLinear does)
 *   db print%          m-buffer-<hex> lines (32 bytes each) of the input buffer
 *   infer N W%         m-warmup-start-W, m-warmup-done, m-infer-start-N, m-lap-us-<t0>,
 *                      m-lap-us-<t1>, m-infer-done, m-results-[...]; 1 <= N <= TD_INFER_MAX and
 *                      W <= TD_INFER_MAX (a device busy for 2^32 runs would be deaf until reset)
 *   results%           m-results-[...] of the last inference, %0.3f: float outputs as they are,
 *                      8-bit outputs dequantised (TD_OUT_SCALES); with TD_RESULTS_MSE one value,
 *                      the mean squared error between output 0 dequantised and the float32 input
 * These follow what the open MLCommons runner expects (firmware_templates/mcu/profiles.json);
 * m-lap-us-N is the port's port_us(): the board's microseconds (under QEMU, those of the
 * emulated board's clock, TD_US_CLOCK_HZ).
 * Extensions:
 *   bload N CRC%       binary load: m-bload-ready-N, then exactly N raw bytes whose CRC-32
 *                      (IEEE, as zlib.crc32) is CRC in hex; m-load-done or e-[crc ...]. A pause
 *                      of more than TD_BULK_TIMEOUT_MS between bytes aborts it with e-[timeout ...];
 *                      its m-ready follows once the rest of the announced bytes has arrived or the
 *                      line has been quiet for TD_BULK_TIMEOUT_MS again: late bytes of the load are
 *                      discarded, never run as commands.
 *   rawout%            m-rawout-bytes-N, then m-raw-<hex> lines (32 bytes each): every output
 *                      tensor's bytes, back to back, exactly as td_output(i) holds them
 *   ticks%             m-ticks-total-T-runs-N-min-A-max-B-hz-H: port ticks per timed run of the
 *                      last infer command (sum over its N runs in 64 bits, fastest, slowest), then
 *                      m-count-total-C-min-X-max-Y-unit-[U]: the port's work counter around
 *                      td_run() alone (U: instructions under QEMU -icount shift=0, exact;
 *                      cycles on the nRF52840; ticks where nothing better exists)
 *   stack%             m-stack-used-U-of-R bytes (stack painted at reset)
 *   quit%              m-bye, then port_exit(0) (ends an emulator; resets a real board)
 *   model NAME%        images with several models (TD_MODEL_SELECT, model.h): m-model-selected-[NAME];
 *                      the following commands act on that model; model% lists them:
 *                      m-models-[a b ...]-selected-[NAME]
 *   capture T%         only in the capture build (-DTD_CAPTURE -DTD_PROFILE, `tinydeploy
 *                      validate`): one inference of the loaded input with every layer's outputs
 *                      sent (T = 1) or not (T = 0), and the work counter around each layer; see
 *                      the capture extension below
 * The input buffer holds every model input back to back (td_input_bytes(0) + ...); each
 * inference copies it into the model's inputs first, so repeated runs see the same data.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "model.h"
#include "port.h"
#include "harness.h"
#include "harness_config.h"

#ifndef TD_DUT_NAME
#define TD_DUT_NAME "tinydeploy"
#endif
#ifndef TD_MODEL_ID
#define TD_MODEL_ID "tinydeploy"
#endif
#ifndef TD_DB_SUBTRACT_128
#define TD_DB_SUBTRACT_128 0
#endif
#ifndef TD_BULK_TIMEOUT_MS
#define TD_BULK_TIMEOUT_MS 2000u
#endif
#ifndef TD_RESULTS_DEQUANTISE
#define TD_RESULTS_DEQUANTISE 0
#endif
#ifndef TD_RESULTS_MSE
#define TD_RESULTS_MSE 0
#endif
#ifndef TD_DB_FLOAT32
#define TD_DB_FLOAT32 0
#endif
#define TD_FLOAT_WINDOW (TD_RESULTS_MSE || TD_DB_FLOAT32)
#if TD_FLOAT_WINDOW && !defined(TD_IN_SCALE)
#error "TD_RESULTS_MSE and TD_DB_FLOAT32 need the input's TD_IN_SCALE, TD_IN_ZERO_POINT, TD_IN_LO, TD_IN_HI"
#endif

#ifndef TD_INFER_MAX
#define TD_INFER_MAX 1000000u
#endif

#define TD_CMD_MAX 80

/* Total input bytes and the output element types, from model.h (up to 8 inputs and outputs). */
#if TD_NUM_INPUTS < 1 || TD_NUM_INPUTS > 8 || TD_NUM_OUTPUTS < 1 || TD_NUM_OUTPUTS > 8
#error "the harness supports 1 to 8 model inputs and outputs"
#endif
#define TD_IN_BYTES_AT(i) (TD_NUM_INPUTS > (i) ? TD_IN_BYTES_##i : 0u)
#ifdef TD_INPUT0_BYTES
#define TD_IN_BYTES_0 TD_INPUT0_BYTES
#endif
#ifdef TD_INPUT1_BYTES
#define TD_IN_BYTES_1 TD_INPUT1_BYTES
#else
#define TD_IN_BYTES_1 0u
#endif
#ifdef TD_INPUT2_BYTES
#define TD_IN_BYTES_2 TD_INPUT2_BYTES
#else
#define TD_IN_BYTES_2 0u
#endif
#ifdef TD_INPUT3_BYTES
#define TD_IN_BYTES_3 TD_INPUT3_BYTES
#else
#define TD_IN_BYTES_3 0u
#endif
#ifdef TD_INPUT4_BYTES
#define TD_IN_BYTES_4 TD_INPUT4_BYTES
#else
#define TD_IN_BYTES_4 0u
#endif
#ifdef TD_INPUT5_BYTES
#define TD_IN_BYTES_5 TD_INPUT5_BYTES
#else
#define TD_IN_BYTES_5 0u
#endif
#ifdef TD_INPUT6_BYTES
#define TD_IN_BYTES_6 TD_INPUT6_BYTES
#else
#define TD_IN_BYTES_6 0u
#endif
#ifdef TD_INPUT7_BYTES
#define TD_IN_BYTES_7 TD_INPUT7_BYTES
#else
#define TD_IN_BYTES_7 0u
#endif
#define TD_IN_TOTAL (TD_IN_BYTES_0 + TD_IN_BYTES_1 + TD_IN_BYTES_2 + TD_IN_BYTES_3 + \
                     TD_IN_BYTES_4 + TD_IN_BYTES_5 + TD_IN_BYTES_6 + TD_IN_BYTES_7)

#ifndef TD_OUT_DTYPE   /* model.h may give the types at run time (an image of several models) */
#define TD_OUT_DTYPE(i) td_out_dtype[i]
static const unsigned char td_out_dtype[TD_NUM_OUTPUTS] = {
    TD_OUTPUT0_DTYPE
#if TD_NUM_OUTPUTS > 1
    , TD_OUTPUT1_DTYPE
#endif
#if TD_NUM_OUTPUTS > 2
    , TD_OUTPUT2_DTYPE
#endif
#if TD_NUM_OUTPUTS > 3
    , TD_OUTPUT3_DTYPE
#endif
#if TD_NUM_OUTPUTS > 4
    , TD_OUTPUT4_DTYPE
#endif
#if TD_NUM_OUTPUTS > 5
    , TD_OUTPUT5_DTYPE
#endif
#if TD_NUM_OUTPUTS > 6
    , TD_OUTPUT6_DTYPE
#endif
#if TD_NUM_OUTPUTS > 7
    , TD_OUTPUT7_DTYPE
#endif
};
#endif

/* The input buffer the host loads (aligned for any element type). */
static union {
    unsigned char bytes[TD_IN_TOTAL];
    double align_;
} td_in;

#if TD_RESULTS_DEQUANTISE
/* Per output: scale and zero point of an 8-bit output (scale 0: printed as stored). */
static const float td_out_scale[TD_NUM_OUTPUTS] = TD_OUT_SCALES;
static const int32_t td_out_zp[TD_NUM_OUTPUTS] = TD_OUT_ZERO_POINTS;
#endif
#if TD_FLOAT_WINDOW
/* The float32 input window (AD): what db load sent, or a binary load's input dequantised. */
static float td_fin[TD_IN_TOTAL];
static unsigned char db_fbytes[4];
#endif

static char cmd[TD_CMD_MAX + 1];
static unsigned cmd_len;
static int cmd_too_long, cmd_bad_byte;

static uint32_t db_expect, db_have;   /* db load in progress when db_expect > 0 */
static int have_results;
static uint32_t last_runs, last_min, last_max;
static uint64_t last_ticks, last_count;
static uint32_t last_count_min, last_count_max;

/* ---- output ------------------------------------------------------------------------------ */

static void put(const char *s)
{
    while (*s) {
        port_putc(*s++);
    }
}

static void endl(void)
{
    port_putc('\r');
    port_putc('\n');
}

static void line(const char *s)
{
    put(s);
    endl();
}

static void put_u64(uint64_t v)
{
    char buf[21];
    int n = 0;
    do {
        buf[n++] = (char)('0' + (unsigned)(v % 10u));
        v /= 10u;
    } while (v);
    while (n) {
        port_putc(buf[--n]);
    }
}

static void put_u32(uint32_t v)
{
    char buf[11];
    int n = 0;
    do {
        buf[n++] = (char)('0' + v % 10u);
        v /= 10u;
    } while (v);
    while (n) {
        port_putc(buf[--n]);
    }
}

static void put_i32(int32_t v)
{
    if (v < 0) {
        port_putc('-');
        put_u32((uint32_t)0 - (uint32_t)v);
    } else {
        put_u32((uint32_t)v);
    }
}

static void put_hex8(unsigned v)
{
    static const char digits[] = "0123456789abcdef";
    port_putc(digits[(v >> 4) & 15u]);
    port_putc(digits[v & 15u]);
}

/* printf("%0.3f") without printf: finite values below 4e9 exactly rounded to 3 decimals, larger
 * magnitudes as d.ddde+XX, and nan / inf / -inf. */
static void put_f32(float v)
{
    uint32_t ip, frac;
    if (v != v) {
        put("nan");
        return;
    }
    if (v < 0.0f) {
        port_putc('-');
        v = -v;
    }
    if (v > 3.4028235e38f) {
        put("inf");
        return;
    }
    if (v >= 4.0e9f) {
        int e = 0;
        while (v >= 10.0f) {
            v /= 10.0f;
            ++e;
        }
        frac = (uint32_t)(v * 1000.0f + 0.5f);
        if (frac >= 10000u) {
            frac /= 10u;
            ++e;
        }
        put_u32(frac / 1000u);
        port_putc('.');
        port_putc((char)('0' + frac / 100u % 10u));
        port_putc((char)('0' + frac / 10u % 10u));
        port_putc((char)('0' + frac % 10u));
        put("e+");
        put_u32((uint32_t)e);
        return;
    }
    ip = (uint32_t)v;
    frac = (uint32_t)((v - (float)ip) * 1000.0f + 0.5f);
    if (frac >= 1000u) {
        ++ip;
        frac -= 1000u;
    }
    put_u32(ip);
    port_putc('.');
    port_putc((char)('0' + frac / 100u));
    port_putc((char)('0' + frac / 10u % 10u));
    port_putc((char)('0' + frac % 10u));
}

/* e-[<msg><detail>] */
static void error2(const char *msg, const char *detail)
{
    put("e-[");
    put(msg);
    put(detail);
    line("]");
}

static void error(const char *msg)
{
    error2(msg, "");
}

static void ready(void)
{
    line("m-ready");
}

static void hex_lines(const char *prefix, const unsigned char *p, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i) {
        if (i % 32u == 0) {
            if (i) {
                endl();
            }
            put(prefix);
        }
        put_hex8(p[i]);
    }
    if (n) {
        endl();
    }
}

/* ---- parsing ----------------------------------------------------------------------------- */

/* Decimal u32 with overflow check; returns 0 when s is not one. */
static int parse_u32(const char *s, uint32_t *out)
{
    uint32_t v = 0;
    if (!*s) {
        return 0;
    }
    for (; *s; ++s) {
        const uint32_t d = (uint32_t)(*s - '0');
        if (d > 9u || v > (0xFFFFFFFFu - d) / 10u) {
            return 0;
        }
        v = v * 10u + d;
    }
    *out = v;
    return 1;
}

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    if (c >= 'A' && c <= 'F') {
        return c - 'A' + 10;
    }
    return -1;
}

static int parse_hex32(const char *s, uint32_t *out)
{
    uint32_t v = 0;
    int n = 0;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
        s += 2;
    }
    for (; *s; ++s, ++n) {
        const int d = hex_digit(*s);
        if (d < 0 || n >= 8) {
            return 0;
        }
        v = (v << 4) | (uint32_t)d;
    }
    if (!n) {
        return 0;
    }
    *out = v;
    return 1;
}

/* Splits cmd in place at spaces; returns the number of tokens (at most max). */
static int tokenize(char *s, char **tok, int max)
{
    int n = 0;
    while (*s) {
        while (*s == ' ') {
            *s++ = '\0';
        }
        if (!*s) {
            break;
        }
        if (n == max) {
            return max + 1;
        }
        tok[n++] = s;
        while (*s && *s != ' ') {
            ++s;
        }
    }
    return n;
}

/* ---- CRC-32 (IEEE 802.3, reflected, as zlib.crc32), a nibble at a time -------------------- */

static uint32_t crc32_update(uint32_t crc, unsigned char b)
{
    static const uint32_t t[16] = {
        0x00000000u, 0x1DB71064u, 0x3B6E20C8u, 0x26D930ACu, 0x76DC4190u, 0x6B6B51F4u, 0x4DB26158u, 0x5005713Cu,
        0xEDB88320u, 0xF00F9344u, 0xD6D6A3E8u, 0xCB61B38Cu, 0x9B64C2B0u, 0x86D3D2D4u, 0xA00AE278u, 0xBDBDF21Cu,
    };
    crc ^= b;
    crc = (crc >> 4) ^ t[crc & 15u];
    crc = (crc >> 4) ^ t[crc & 15u];
    return crc;
}

/* ---- commands ---------------------------------------------------------------------------- */

static void copy_inputs(void)
{
    const unsigned char *p = td_in.bytes;
    int i;
    for (i = 0; i < TD_NUM_INPUTS; ++i) {
        memcpy(td_input(i), p, td_input_bytes(i));
        p += td_input_bytes(i);
    }
}

#if TD_FLOAT_WINDOW
/* QuantizeLinear (docs/quantization.md): clamp(rne(f32(x / s)) + zp, lo, hi), NaN gives zp. The
 * quotient is clamped first (the result is the same) so that adding 1.5 * 2^23 rounds it to the
 * nearest integer, ties to even, in the FPU's default rounding mode. */
static unsigned char quantise_in(float x)
{
    float v = x / TD_IN_SCALE;
    int32_t q;
    if (v != v) {
        v = 0.0f;
    }
    if (v < (float)(TD_IN_LO - TD_IN_ZERO_POINT - 1)) {
        v = (float)(TD_IN_LO - TD_IN_ZERO_POINT - 1);
    }
    if (v > (float)(TD_IN_HI - TD_IN_ZERO_POINT + 1)) {
        v = (float)(TD_IN_HI - TD_IN_ZERO_POINT + 1);
    }
    v = (v + 12582912.0f) - 12582912.0f;
    q = (int32_t)v + TD_IN_ZERO_POINT;
    q = q < TD_IN_LO ? TD_IN_LO : q > TD_IN_HI ? TD_IN_HI : q;
    return (unsigned char)(q & 0xFF);
}

/* After a binary load: the float window is the 8-bit input dequantised. */
static void dequantise_input(void)
{
    uint32_t k;
    for (k = 0; k < TD_IN_TOTAL; ++k) {
        const int32_t q = TD_IN_LO < 0 ? (int32_t)(signed char)td_in.bytes[k] : (int32_t)td_in.bytes[k];
        td_fin[k] = (float)(q - TD_IN_ZERO_POINT) * TD_IN_SCALE;
    }
}
#endif

#if TD_RESULTS_DEQUANTISE
/* DequantizeLinear: f32(f32(q - zero point) * scale). */
static float dequantise_out(int i, int32_t q)
{
    return (float)(q - td_out_zp[i]) * td_out_scale[i];
}
#endif

static void print_results(void)
{
    int i;
    size_t k;
    int first = 1;
    put("m-results-[");
#if TD_RESULTS_MSE
    {
        /* mean over output 0 of (dequantised output - float input)^2, float32 in index order */
        const unsigned char *o = (const unsigned char *)td_output(0);
        const size_t n = td_output_bytes(0);
        float acc = 0.0f;
        for (k = 0; k < n && k < TD_IN_TOTAL; ++k) {
            const int32_t q = TD_OUT_DTYPE(0) == TD_INT8 ? (int32_t)(signed char)o[k] : (int32_t)o[k];
            const float d = dequantise_out(0, q) - td_fin[k];
            acc += d * d;
        }
        put_f32(acc / (float)n);
        line("]");
        (void)i;
        (void)first;
        return;
    }
#endif
    for (i = 0; i < TD_NUM_OUTPUTS; ++i) {
        const void *o = td_output(i);
        const size_t n = td_output_bytes(i);
        if (TD_OUT_DTYPE(i) == TD_FLOAT32) {
            for (k = 0; k < n / sizeof(float); ++k, first = 0) {
                float v;
                memcpy(&v, (const unsigned char *)o + k * sizeof v, sizeof v);
                put(first ? "" : ",");
                put_f32(v);
            }
        } else if (TD_OUT_DTYPE(i) == TD_INT32) {
            for (k = 0; k < n / sizeof(int32_t); ++k, first = 0) {
                int32_t v;
                memcpy(&v, (const unsigned char *)o + k * sizeof v, sizeof v);
                put(first ? "" : ",");
                put_i32(v);
            }
        } else {
            for (k = 0; k < n; ++k, first = 0) {
                const unsigned char b = ((const unsigned char *)o)[k];
                const int32_t q = TD_OUT_DTYPE(i) == TD_INT8 ? (int32_t)(signed char)b : (int32_t)b;
                put(first ? "" : ",");
#if TD_RESULTS_DEQUANTISE
                if (td_out_scale[i] != 0.0f) {
                    put_f32(dequantise_out(i, q));
                    continue;
                }
#endif
                put_i32(q);
            }
        }
    }
    line("]");
}

static void cmd_infer(char **tok, int n)
{
    uint32_t runs = 1, warm = 0, i, t0, dt, lo = 0xFFFFFFFFu, hi = 0, c, clo = 0xFFFFFFFFu, chi = 0;
    uint64_t total = 0, ctotal = 0;   /* 64 bits: a 16 MHz tick counter's 32-bit sum wraps after 268 s */
    if (n > 3 || (n >= 2 && !parse_u32(tok[1], &runs)) || (n == 3 && !parse_u32(tok[2], &warm)) || runs == 0 ||
        runs > TD_INFER_MAX || warm > TD_INFER_MAX) {
        put("e-[usage: infer N W (1 <= N <= ");
        put_u32(TD_INFER_MAX);
        put(" timed runs after W <= ");
        put_u32(TD_INFER_MAX);
        line(" warm-up runs)]");
        return;
    }
    if (db_expect) {
        error("db load is not complete");
        return;
    }
    put("m-warmup-start-");
    put_u32(warm);
    endl();
    for (i = 0; i < warm; ++i) {
        copy_inputs();
        td_run();
    }
    line("m-warmup-done");
    put("m-infer-start-");
    put_u32(runs);
    endl();
    put("m-lap-us-");
    put_u32(port_us());
    endl();
    for (i = 0; i < runs; ++i) {
        copy_inputs();
        t0 = port_ticks();
        port_count_begin();
        td_run();
        c = port_count_end();
        dt = port_ticks() - t0;
        ctotal += c;
        clo = c < clo ? c : clo;
        chi = c > chi ? c : chi;
        total += dt;
        lo = dt < lo ? dt : lo;
        hi = dt > hi ? dt : hi;
    }
    put("m-lap-us-");
    put_u32(port_us());
    endl();
    line("m-infer-done");
    last_ticks = total;
    last_runs = runs;
    last_min = lo;
    last_max = hi;
    last_count = ctotal;
    last_count_min = clo;
    last_count_max = chi;
    have_results = 1;
    print_results();
}

static void cmd_db(char **tok, int n)
{
    uint32_t want;
    if (n == 3 && !strcmp(tok[1], "load")) {
#if TD_DB_FLOAT32
        if (!parse_u32(tok[2], &want) || want == 0 || want > 4u * TD_IN_TOTAL || want % 4u) {
            put("e-[db load: N must be 4..");
            put_u32(4u * TD_IN_TOTAL);
            line(", a multiple of 4 (float32 values)]");
            return;
        }
#else
        if (!parse_u32(tok[2], &want) || want == 0 || want > TD_IN_TOTAL) {
            put("e-[db load: N must be 1..");
            put_u32(TD_IN_TOTAL);
            line(" (the input buffer size)]");
            return;
        }
#endif
        db_expect = want;
        db_have = 0;
        put("m-[Expecting ");
        put_u32(want);
        line(" bytes]");
    } else if (n == 2 && !strcmp(tok[1], "print")) {
        hex_lines("m-buffer-", td_in.bytes, TD_IN_TOTAL);
    } else if (n == 2) {
        const char *h = tok[1];
        const size_t len = strlen(h);
        size_t i;
        if (!db_expect) {
            error("db: no db load in progress");
            return;
        }
        if (len % 2u) {
            error("db: odd number of hex digits");
            return;
        }
        for (i = 0; i < len; ++i) {
            if (hex_digit(h[i]) < 0) {
                error("db: not hex");
                return;
            }
        }
        if (len / 2u > db_expect - db_have) {
            error("db: more bytes than db load announced");
            db_expect = 0;
            return;
        }
        for (i = 0; i < len; i += 2) {
            const unsigned v = (unsigned)(hex_digit(h[i]) * 16 + hex_digit(h[i + 1]));
#if TD_DB_FLOAT32
            /* little-endian float32 values, quantised as each one completes */
            db_fbytes[db_have % 4u] = (unsigned char)v;
            if (++db_have % 4u == 0) {
                const uint32_t bits = (uint32_t)db_fbytes[0] | (uint32_t)db_fbytes[1] << 8 |
                                      (uint32_t)db_fbytes[2] << 16 | (uint32_t)db_fbytes[3] << 24;
                float f;
                memcpy(&f, &bits, sizeof f);
                td_fin[db_have / 4u - 1u] = f;
                td_in.bytes[db_have / 4u - 1u] = quantise_in(f);
            }
#else
            /* uint8 pixels -> int8 (v - 128) for the MLPerf Tiny image models, as the runner expects */
            td_in.bytes[db_have++] = (unsigned char)(TD_DB_SUBTRACT_128 ? v ^ 0x80u : v);
#endif
        }
        if (db_have == db_expect) {
            db_expect = 0;
            line("m-load-done");
        }
    } else {
        error("usage: db load N | db <hex> | db print");
    }
}

static uint32_t bulk_limit_ticks(void)
{
    return (uint32_t)((uint64_t)port_tick_hz() * TD_BULK_TIMEOUT_MS / 1000u);
}

/* After a timed-out bulk load: discards the late bytes of the load, up to the `left` still
 * announced, until the line has been quiet for TD_BULK_TIMEOUT_MS, so that none of them is
 * taken for a command. */
static void bulk_discard(uint32_t left)
{
    const uint32_t limit = bulk_limit_ticks();
    uint32_t last = port_ticks();
    while (left && port_ticks() - last <= limit) {
        if (port_getc() >= 0) {
            --left;
            last = port_ticks();
        }
    }
}

/* Reads exactly n raw bytes into the input buffer; 0 on success, else the bytes received. */
static int bulk_read(uint32_t n, uint32_t *got, uint32_t *crc)
{
    const uint32_t limit = bulk_limit_ticks();
    uint32_t i, last = port_ticks();
    uint32_t c = 0xFFFFFFFFu;
    for (i = 0; i < n;) {
        const int b = port_getc();
        if (b < 0) {
            if (port_ticks() - last > limit) {
                *got = i;
                return -1;
            }
            continue;
        }
        td_in.bytes[i++] = (unsigned char)b;
        c = crc32_update(c, (unsigned char)b);
        last = port_ticks();
    }
    *got = n;
    *crc = c ^ 0xFFFFFFFFu;
    return 0;
}

static void cmd_bload(char **tok, int n)
{
    uint32_t want, crc, got, have_crc = 0;
    if (n != 3 || !parse_u32(tok[1], &want) || !parse_hex32(tok[2], &crc)) {
        error("usage: bload N CRC32HEX");
        return;
    }
    if (want == 0 || want > TD_IN_TOTAL) {
        put("e-[bload: N must be 1..");
        put_u32(TD_IN_TOTAL);
        line(" (the input buffer size)]");
        return;
    }
    db_expect = 0;
    put("m-bload-ready-");
    put_u32(want);
    endl();
    if (bulk_read(want, &got, &have_crc)) {
        put("e-[timeout: bulk load got ");
        put_u32(got);
        put(" of ");
        put_u32(want);
        line(" bytes]");
        bulk_discard(want - got);   /* m-ready follows once the late bytes are gone */
        return;
    }
    if (have_crc != crc) {
        put("e-[crc mismatch: received data has crc ");
        put_hex8(have_crc >> 24);
        put_hex8(have_crc >> 16);
        put_hex8(have_crc >> 8);
        put_hex8(have_crc);
        line("]");
        return;
    }
#if TD_FLOAT_WINDOW
    dequantise_input();
#endif
    line("m-load-done");
}

static void cmd_rawout(void)
{
    int i;
    uint32_t total = 0;
    for (i = 0; i < TD_NUM_OUTPUTS; ++i) {
        total += (uint32_t)td_output_bytes(i);
    }
    put("m-rawout-bytes-");
    put_u32(total);
    endl();
    for (i = 0; i < TD_NUM_OUTPUTS; ++i) {
        hex_lines("m-raw-", (const unsigned char *)td_output(i), (uint32_t)td_output_bytes(i));
    }
}

#ifdef TD_MODEL_SELECT
static void cmd_model(char **tok, int n)
{
    int k;
    if (n == 1) {
        put("m-models-[");
        for (k = 0; k < TD_NUM_MODELS; ++k) {
            put(k ? " " : "");
            put(td_model_name(k));
        }
        put("]-selected-[");
        put(td_model_name(td_current_model()));
        line("]");
    } else if (n == 2 && td_select_model(tok[1]) == 0) {
        db_expect = 0;
        have_results = 0;
        put("m-model-selected-[");
        put(tok[1]);
        line("]");
    } else if (n == 2) {
        error2("unknown model: ", tok[1]);
    } else {
        error("usage: model NAME");
    }
}
#endif

/* ---- capture extension (the capture build of `tinydeploy validate`) ----------------------
 * capture T%: copies the input buffer into the model's inputs and runs one inference. model.c
 * calls td_capture() after each layer; with T = 1 it sends each output of the layer straight
 * from the arena, one layer at a time (nothing is copied, the arena does not grow):
 *   m-layer-<step>-<index>-<dtype>-<bytes>-<crc32 hex>   (dtype: TD_FLOAT32 = 1, TD_UINT8 = 2, ...)
 * then exactly <bytes> raw bytes, and waits for one byte from the host: '+' go on, 'r' send the
 * same tensor again (the host's CRC-32 did not match; at most TD_CAPTURE_RESENDS times), 'x'
 * send no more. model.c's profile hooks count the port's work counter around each layer's call
 * alone (instructions under QEMU -icount shift=0, DWT cycles where the port has them). After the
 * inference: one m-layer-count-<step>-<count> line per layer with code, m-count-unit-[U],
 * m-capture-done-<tensors sent>, and the results as infer% prints them. Without an answer within
 * TD_CAPTURE_ACK_MS the rest is not sent and the reply ends with e-[capture: ...]. */
#ifdef TD_CAPTURE
#ifndef TD_PROFILE
#error "the capture build needs TD_PROFILE too (the per-layer counts)"
#endif
#ifndef TD_CAPTURE_RESENDS
#define TD_CAPTURE_RESENDS 3
#endif
#ifndef TD_CAPTURE_ACK_MS
#define TD_CAPTURE_ACK_MS (10u * TD_BULK_TIMEOUT_MS)
#endif

static int capture_active, capture_send, capture_stopped, capture_timeout;
static uint32_t capture_sent;
static uint32_t layer_count[TD_NUM_STEPS + 1];       /* + 1: never a zero-length array */
static unsigned char layer_counted[TD_NUM_STEPS + 1];

void td_profile_begin(int layer);
void td_profile_end(int layer);

void td_profile_begin(int layer)
{
    (void)layer;
    if (capture_active) {
        port_count_begin();
    }
}

void td_profile_end(int layer)
{
    const uint32_t c = capture_active ? port_count_end() : 0u;
    if (capture_active && layer >= 0 && layer < TD_NUM_STEPS) {
        layer_count[layer] = c;
        layer_counted[layer] = 1;
    }
}

/* The host's answer to a sent tensor, or -1 after TD_CAPTURE_ACK_MS without one. */
static int capture_answer(void)
{
    const uint32_t limit = (uint32_t)((uint64_t)port_tick_hz() * TD_CAPTURE_ACK_MS / 1000u);
    const uint32_t t0 = port_ticks();
    for (;;) {
        const int b = port_getc();
        if (b == '+' || b == 'r' || b == 'x') {
            return b;
        }
        if (port_ticks() - t0 > limit) {
            return -1;
        }
    }
}

void td_capture(int step, int index, int dtype, const void *data, size_t bytes)
{
    const unsigned char *p = (const unsigned char *)data;
    uint32_t crc = 0xFFFFFFFFu, i;
    int tries;
    if (!capture_active || !capture_send || capture_stopped) {
        return;
    }
    for (i = 0; i < (uint32_t)bytes; ++i) {
        crc = crc32_update(crc, p[i]);
    }
    crc ^= 0xFFFFFFFFu;
    for (tries = 0; tries <= TD_CAPTURE_RESENDS; ++tries) {
        int answer;
        put("m-layer-");
        put_u32((uint32_t)step);
        port_putc('-');
        put_u32((uint32_t)index);
        port_putc('-');
        put_u32((uint32_t)dtype);
        port_putc('-');
        put_u32((uint32_t)bytes);
        port_putc('-');
        put_hex8(crc >> 24);
        put_hex8(crc >> 16);
        put_hex8(crc >> 8);
        put_hex8(crc);
        endl();
        for (i = 0; i < (uint32_t)bytes; ++i) {
            port_putc((char)p[i]);
        }
        answer = capture_answer();
        if (answer == '+') {
            ++capture_sent;
            return;
        }
        if (answer != 'r') {
            capture_timeout = answer < 0;
            break;
        }
    }
    capture_stopped = 1;
}

static void cmd_capture(char **tok, int n)
{
    uint32_t send = 1;
    int i;
    if (n != 2 || !parse_u32(tok[1], &send) || send > 1u) {
        error("usage: capture T (T = 1: send every layer's outputs, 0: per-layer counts only)");
        return;
    }
    if (db_expect) {
        error("db load is not complete");
        return;
    }
    for (i = 0; i < TD_NUM_STEPS; ++i) {
        layer_counted[i] = 0;
    }
    capture_send = (int)send;
    capture_stopped = capture_timeout = 0;
    capture_sent = 0;
    copy_inputs();
    capture_active = 1;
    td_run();
    capture_active = 0;
    for (i = 0; i < TD_NUM_STEPS; ++i) {
        if (layer_counted[i]) {
            put("m-layer-count-");
            put_u32((uint32_t)i);
            port_putc('-');
            put_u32(layer_count[i]);
            endl();
        }
    }
    put("m-count-unit-[");
    put(port_count_unit());
    line("]");
    put("m-capture-done-");
    put_u32(capture_sent);
    endl();
    have_results = 1;
    print_results();
    if (capture_stopped) {
        error(capture_timeout ? "capture: no answer from the host after a tensor; the rest was not sent"
                              : "capture: stopped (the host asked, or a tensor failed its CRC too often)");
    }
}
#endif

static void execute(void)
{
    char *tok[4];
    const int n = tokenize(cmd, tok, 3);
    if (n == 0) {
        return;
    }
    if (n > 3) {
        error2("too many arguments: ", tok[0]);
    } else if (!strcmp(tok[0], "name") && n == 1) {
        line("m-name-dut-[" TD_DUT_NAME "]");
    } else if (!strcmp(tok[0], "profile") && n == 1) {
        line("m-profile-[ULPMark for tinyML Firmware V0.0.1]");
        line("m-model-[" TD_MODEL_ID "]");
    } else if (!strcmp(tok[0], "timestamp") && n == 1) {
        put("m-lap-us-");
        put_u32(port_us());
        endl();
    } else if (!strcmp(tok[0], "db")) {
        cmd_db(tok, n);
    } else if (!strcmp(tok[0], "infer")) {
        cmd_infer(tok, n);
    } else if (!strcmp(tok[0], "results") && n == 1) {
        if (have_results) {
            print_results();
        } else {
            error("results: no inference has run yet");
        }
    } else if (!strcmp(tok[0], "bload")) {
        cmd_bload(tok, n);
    } else if (!strcmp(tok[0], "rawout") && n == 1) {
        cmd_rawout();
    } else if (!strcmp(tok[0], "ticks") && n == 1) {
        put("m-ticks-total-");
        put_u64(last_ticks);
        put("-runs-");
        put_u32(last_runs);
        put("-min-");
        put_u32(last_runs ? last_min : 0);
        put("-max-");
        put_u32(last_max);
        put("-hz-");
        put_u32(port_tick_hz());
        endl();
        put("m-count-total-");
        put_u64(last_count);
        put("-min-");
        put_u32(last_runs ? last_count_min : 0);
        put("-max-");
        put_u32(last_count_max);
        put("-unit-[");
        put(port_count_unit());
        line("]");
    } else if (!strcmp(tok[0], "stack") && n == 1) {
        uint32_t reserved = 0;
        const uint32_t used = port_stack_used(&reserved);
        put("m-stack-used-");
        put_u32(used);
        put("-of-");
        put_u32(reserved);
        endl();
#ifdef TD_MODEL_SELECT
    } else if (!strcmp(tok[0], "model")) {
        cmd_model(tok, n);
#endif
#ifdef TD_CAPTURE
    } else if (!strcmp(tok[0], "capture")) {
        cmd_capture(tok, n);
#endif
    } else if (!strcmp(tok[0], "quit") && n == 1) {
        line("m-bye");
        port_exit(0);
    } else {
        error2("unknown command: ", tok[0]);
    }
}

/* ---- main loop --------------------------------------------------------------------------- */

void harness_init(void)
{
    port_init();
    line("m-timestamp-mode-performance");
    put("m-model-bytes-in-");
    put_u32(TD_IN_TOTAL);
    put("-arena-");
    put_u32(TD_ARENA_BYTES);
    endl();
    line("m-init-done");
    ready();
}

void harness_feed(int c)
{
    if (c == '%') {
        cmd[cmd_len] = '\0';
        if (cmd_too_long) {
            error("command longer than 80 characters");
        } else if (cmd_bad_byte) {
            error("command has bytes that are not printable ASCII");
        } else {
            execute();
        }
        cmd_len = 0;
        cmd_too_long = cmd_bad_byte = 0;
        ready();
    } else if (c == '\r' || c == '\n') {
        /* ignored: hosts may end commands with a newline too */
    } else if (cmd_len >= TD_CMD_MAX) {
        cmd_too_long = 1;
    } else {
        if (c < 0x20 || c > 0x7e) {
            cmd_bad_byte = 1;
        }
        cmd[cmd_len++] = (char)c;
    }
}

void harness_poll(void)
{
    const int c = port_getc();
    if (c >= 0) {
        harness_feed(c);
    }
}

#ifndef ARDUINO /* Arduino builds call harness_init() from setup() and harness_poll() from loop() */
int main(void)
{
    harness_init();
    for (;;) {
        harness_poll();
    }
}
#endif
