/*
 * The onnxruntime peer of a tinydeploy build, for counting both in the same unit under user-mode
 * QEMU (tinydeploy/runners/ort_aarch64.py, `tinydeploy bench --board rpi4 --emulate`).
 *
 *   ort_peer LIBONNXRUNTIME.so MODEL.onnx IN.bin OUT.bin RUNS
 *   ort_peer --cpu        prints "midr 0x.. hwcap 0x.. hwcap2 0x..": the emulated core, from which
 *                         tinydeploy writes the /proc/cpuinfo onnxruntime reads
 *
 * Loads onnxruntime's shared library (the one in its PyPI wheel), opens a session on MODEL.onnx
 * with one intra-op and one inter-op thread and the default graph optimisations (what `tinydeploy
 * bench` uses on the host), reads the inputs back to back from IN.bin (the same bytes tinydeploy's
 * harness reads), runs the model RUNS times and writes the outputs of the last run back to back to
 * OUT.bin. Each inference is one call of td_peer_run, which the counting plugin uses as its
 * window: the session's creation and the file I/O are outside it.
 *
 * Compiled by tinydeploy at bench time against onnxruntime's C API headers, which are not part of
 * tinydeploy. Exit status: 0 ok, 1 onnxruntime failed, 2 bad usage or input file.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>

#include "onnxruntime_c_api.h"

#define MAX_IO 64

static const OrtApi *ort;

/* Stops with onnxruntime's message when `st` is an error. */
static void check(OrtStatus *st, const char *what)
{
    if (st != NULL) {
        fprintf(stderr, "error: onnxruntime %s: %s\n", what, ort->GetErrorMessage(st));
        ort->ReleaseStatus(st);
        exit(1);
    }
}

static size_t element_bytes(ONNXTensorElementDataType t)
{
    switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL:
        return 1;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
        return 2;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32:
        return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64:
        return 8;
    default:
        return 0;
    }
}

static OrtSession *session;
static const char *in_names[MAX_IO], *out_names[MAX_IO];
static OrtValue *inputs[MAX_IO], *outputs[MAX_IO];
static size_t n_in, n_out;

/* One inference: the counting plugin's window (kept a function of its own). */
__attribute__((noinline)) void td_peer_run(void)
{
    size_t i;
    for (i = 0; i < n_out; ++i) {
        if (outputs[i] != NULL) {
            ort->ReleaseValue(outputs[i]);
            outputs[i] = NULL;
        }
    }
    check(ort->Run(session, NULL, in_names, (const OrtValue *const *)inputs, n_in, out_names, n_out, outputs),
          "Run");
}

/* fopen, or exit 2 with the file's name */
static FILE *open_or_stop(const char *path, const char *mode)
{
    FILE *f = fopen(path, mode);
    if (f == NULL) {
        fprintf(stderr, "error: cannot %s %s\n", mode[0] == 'r' ? "open" : "write", path);
        exit(2);
    }
    return f;
}

int main(int argc, char **argv)
{
    void *lib;
    const OrtApiBase *(*get_base)(void);
    OrtEnv *env;
    OrtSessionOptions *opts;
    OrtAllocator *alloc;
    OrtMemoryInfo *mem;
    FILE *f;
    size_t i;
    long runs, r;
    if (argc == 2 && strcmp(argv[1], "--cpu") == 0) {
        unsigned long midr = 0;
#if defined(__aarch64__)
        __asm__ volatile("mrs %0, midr_el1" : "=r"(midr));
#endif
        printf("midr 0x%lx hwcap 0x%lx hwcap2 0x%lx\n", midr, getauxval(AT_HWCAP), getauxval(AT_HWCAP2));
        return 0;
    }
    if (argc != 6) {
        fprintf(stderr, "usage: %s LIBONNXRUNTIME.so MODEL.onnx IN.bin OUT.bin RUNS\n", argv[0]);
        return 2;
    }
    runs = atol(argv[5]);
    if (runs < 1 || runs > 100000) {
        fprintf(stderr, "error: RUNS must be 1..100000\n");
        return 2;
    }
    lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "error: cannot load %s: %s\n", argv[1], dlerror());
        return 2;
    }
    *(void **)&get_base = dlsym(lib, "OrtGetApiBase");
    if (get_base == NULL) {
        fprintf(stderr, "error: %s has no OrtGetApiBase\n", argv[1]);
        return 2;
    }
    ort = get_base()->GetApi(ORT_API_VERSION);
    if (ort == NULL) {
        fprintf(stderr, "error: %s does not offer C API version %d (onnxruntime %s)\n", argv[1], ORT_API_VERSION,
                get_base()->GetVersionString());
        return 2;
    }
    check(ort->CreateEnv(ORT_LOGGING_LEVEL_ERROR, "tinydeploy-peer", &env), "CreateEnv");
    check(ort->CreateSessionOptions(&opts), "CreateSessionOptions");
    check(ort->SetIntraOpNumThreads(opts, 1), "SetIntraOpNumThreads");
    check(ort->SetInterOpNumThreads(opts, 1), "SetInterOpNumThreads");
    check(ort->SetSessionExecutionMode(opts, ORT_SEQUENTIAL), "SetSessionExecutionMode");
    check(ort->CreateSession(env, argv[2], opts, &session), "CreateSession");
    check(ort->GetAllocatorWithDefaultOptions(&alloc), "GetAllocatorWithDefaultOptions");
    check(ort->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &mem), "CreateCpuMemoryInfo");
    check(ort->SessionGetInputCount(session, &n_in), "SessionGetInputCount");
    check(ort->SessionGetOutputCount(session, &n_out), "SessionGetOutputCount");
    if (n_in > MAX_IO || n_out > MAX_IO) {
        fprintf(stderr, "error: more than %d inputs or outputs\n", MAX_IO);
        return 2;
    }
    f = open_or_stop(argv[3], "rb");
    for (i = 0; i < n_in; ++i) {
        OrtTypeInfo *type;
        const OrtTensorTypeAndShapeInfo *tensor;
        ONNXTensorElementDataType et;
        int64_t dims[16];
        size_t rank, d, count = 1, bytes;
        void *data;
        char *name;
        check(ort->SessionGetInputName(session, i, alloc, &name), "SessionGetInputName");
        in_names[i] = name;
        check(ort->SessionGetInputTypeInfo(session, i, &type), "SessionGetInputTypeInfo");
        check(ort->CastTypeInfoToTensorInfo(type, &tensor), "CastTypeInfoToTensorInfo");
        check(ort->GetTensorElementType(tensor, &et), "GetTensorElementType");
        check(ort->GetDimensionsCount(tensor, &rank), "GetDimensionsCount");
        if (rank > 16) {
            fprintf(stderr, "error: input %s has rank %zu\n", name, rank);
            return 2;
        }
        check(ort->GetDimensions(tensor, dims, rank), "GetDimensions");
        for (d = 0; d < rank; ++d) {
            dims[d] = dims[d] < 1 ? 1 : dims[d];      /* a free dimension: 1, as tinydeploy pins it */
            count *= (size_t)dims[d];
        }
        bytes = count * element_bytes(et);
        if (bytes == 0) {
            fprintf(stderr, "error: input %s has an element type this harness does not read\n", name);
            return 2;
        }
        data = malloc(bytes);
        if (data == NULL || fread(data, 1, bytes, f) != bytes) {
            fprintf(stderr, "error: %s is shorter than the model's inputs\n", argv[3]);
            return 2;
        }
        check(ort->CreateTensorWithDataAsOrtValue(mem, data, bytes, dims, rank, et, &inputs[i]),
              "CreateTensorWithDataAsOrtValue");
        ort->ReleaseTypeInfo(type);
    }
    if (fgetc(f) != EOF) {
        fprintf(stderr, "error: %s is longer than the model's inputs\n", argv[3]);
        return 2;
    }
    fclose(f);
    for (i = 0; i < n_out; ++i) {
        char *name;
        check(ort->SessionGetOutputName(session, i, alloc, &name), "SessionGetOutputName");
        out_names[i] = name;
    }
    for (r = 0; r < runs; ++r) {
        td_peer_run();
    }
    f = open_or_stop(argv[4], "wb");
    for (i = 0; i < n_out; ++i) {
        OrtTensorTypeAndShapeInfo *info;
        ONNXTensorElementDataType et;
        size_t count;
        void *data;
        check(ort->GetTensorTypeAndShape(outputs[i], &info), "GetTensorTypeAndShape");
        check(ort->GetTensorElementType(info, &et), "GetTensorElementType");
        check(ort->GetTensorShapeElementCount(info, &count), "GetTensorShapeElementCount");
        check(ort->GetTensorMutableData(outputs[i], &data), "GetTensorMutableData");
        if (fwrite(data, element_bytes(et), count, f) != count) {
            fprintf(stderr, "error: writing %s failed\n", argv[4]);
            return 2;
        }
        ort->ReleaseTensorTypeAndShapeInfo(info);
    }
    if (fclose(f) != 0) {
        fprintf(stderr, "error: writing %s failed\n", argv[4]);
        return 2;
    }
    return 0;
}
