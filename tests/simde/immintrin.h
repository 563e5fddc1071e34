/* Test shim (tests/test_q8_kernels.py): the AVX-512BW and VNNI intrinsics of the 8-bit kernels
 * (AVX-512F/BW, AVX512-VNNI, AVX-VNNI) implemented by SIMDe (libsimde-dev), so that their code
 * runs, and is held to the exact reference, on an x86 CPU without them. Found first through -I
 * by the kernels' `#include <immintrin.h>`: the compiler's own header comes first (its AVX2
 * intrinsics run natively), then SIMDe, then the kernels' _mm512_* / __m512* names mapped onto
 * SIMDe's. The few intrinsics SIMDe 0.7.4 lacks are written here from their two 256-bit halves
 * with the native AVX2 instruction of the same meaning. Never part of a generated project. */
#ifndef TD_TEST_SIMDE_SHIM_H
#define TD_TEST_SIMDE_SHIM_H
#include_next <immintrin.h>
#include <simde/x86/avx512.h>

/* A 512-bit conversion as the native AVX2 one on both 256-bit halves: RT/AT the SIMDe types,
 * RH/AH their halves' fields */
#define TD_SIMDE_HALVES(name, native, RT, RH, AT, AH) \
    static inline simde__##RT name(simde__##AT a) \
    { \
        simde__##AT##_private p = simde__##AT##_to_private(a); \
        simde__##RT##_private r; \
        r.RH[0] = native(p.AH[0]); \
        r.RH[1] = native(p.AH[1]); \
        return simde__##RT##_from_private(r); \
    }
/* vcvtps2dq: float -> int32 in the current rounding mode (to nearest, ties to even) */
TD_SIMDE_HALVES(td_simde_mm512_cvtps_epi32, _mm256_cvtps_epi32, m512i, m256i, m512, m256)
/* vcvtdq2ps: int32 -> float, rounded to nearest even */
TD_SIMDE_HALVES(td_simde_mm512_cvtepi32_ps, _mm256_cvtepi32_ps, m512, m256, m512i, m256i)

/* A widening 512-bit conversion of a 256-bit value as the native AVX2 one on its two 128-bit halves */
#define TD_SIMDE_WIDEN(name, native, RT, RH) \
    static inline simde__##RT name(simde__m256i a) \
    { \
        simde__##RT##_private r; \
        r.RH[0] = native(_mm256_castsi256_si128(a)); \
        r.RH[1] = native(_mm256_extracti128_si256(a, 1)); \
        return simde__##RT##_from_private(r); \
    }
/* vpmovzxbw: 32 bytes, zero-extended to 32 int16 */
TD_SIMDE_WIDEN(td_simde_mm512_cvtepu8_epi16, _mm256_cvtepu8_epi16, m512i, m256i)

/* vpmovusdb: 16 unsigned int32 -> 16 bytes, saturated to 255 */
static inline simde__m128i td_simde_mm512_cvtusepi32_epi8(simde__m512i a)
{
    simde__m512i_private p = simde__m512i_to_private(a);
    const __m256i top = _mm256_set1_epi32(255);
    const __m256i lo = _mm256_min_epu32(p.m256i[0], top), hi = _mm256_min_epu32(p.m256i[1], top);
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
    return _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

/* vpmovuswb: 32 unsigned int16 -> 32 bytes, saturated to 255 */
static inline simde__m256i td_simde_mm512_cvtusepi16_epi8(simde__m512i a)
{
    simde__m512i_private p = simde__m512i_to_private(a);
    const __m256i top = _mm256_set1_epi16(255);
    const __m256i lo = _mm256_min_epu16(p.m256i[0], top), hi = _mm256_min_epu16(p.m256i[1], top);
    return _mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xD8);
}

/* quantised Add (qadd_simd.c.j2): sign/zero extension of 16 bytes to int32, int32 <-> double
 * (the doubles are integers there: no rounding), and the truncating narrowing to bytes */
#define TD_SIMDE_EXT8(name, native) \
    static inline simde__m512i name(simde__m128i a) \
    { \
        simde__m512i_private r; \
        r.m256i[0] = native(a); \
        r.m256i[1] = native(_mm_srli_si128(a, 8)); \
        return simde__m512i_from_private(r); \
    }
TD_SIMDE_EXT8(td_simde_mm512_cvtepi8_epi32, _mm256_cvtepi8_epi32)
TD_SIMDE_EXT8(td_simde_mm512_cvtepu8_epi32, _mm256_cvtepu8_epi32)

TD_SIMDE_WIDEN(td_simde_mm512_cvtepi32_pd, _mm256_cvtepi32_pd, m512d, m256d)

static inline simde__m256i td_simde_mm512_cvtpd_epi32(simde__m512d a)
{
    simde__m512d_private p = simde__m512d_to_private(a);
    return _mm256_set_m128i(_mm256_cvtpd_epi32(p.m256d[1]), _mm256_cvtpd_epi32(p.m256d[0]));
}

static inline simde__m128i td_simde_mm512_cvtepi32_epi8(simde__m512i a)
{
    simde__m512i_private p = simde__m512i_to_private(a);
    signed char b[16];
    int i;
    for (i = 0; i < 16; ++i)
        b[i] = (signed char)p.i32[i];
    return _mm_loadu_si128((const __m128i *)b);
}

/* vpsrad by an immediate (SIMDe 0.7.4 lacks it): both halves by the native AVX2 shift by count */
static inline simde__m512i td_simde_mm512_srai_epi32(simde__m512i a, int n)
{
    simde__m512i_private p = simde__m512i_to_private(a);
    p.m256i[0] = _mm256_sra_epi32(p.m256i[0], _mm_cvtsi32_si128(n));
    p.m256i[1] = _mm256_sra_epi32(p.m256i[1], _mm_cvtsi32_si128(n));
    return simde__m512i_from_private(p);
}

#define __m512d simde__m512d
#define _mm512_cvtepi8_epi32 td_simde_mm512_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 td_simde_mm512_cvtepu8_epi32
#define _mm512_cvtepi32_pd td_simde_mm512_cvtepi32_pd
#define _mm512_cvtpd_epi32 td_simde_mm512_cvtpd_epi32
#define _mm512_cvtepi32_epi8 td_simde_mm512_cvtepi32_epi8
#define _mm512_set1_pd simde_mm512_set1_pd
#define _mm512_fmadd_pd simde_mm512_fmadd_pd
#define _mm512_add_pd simde_mm512_add_pd
#define _mm512_min_pd simde_mm512_min_pd
#define _mm512_max_pd simde_mm512_max_pd
#define _mm512_roundscale_pd simde_mm512_roundscale_pd
#define _mm512_extracti64x4_epi64 simde_mm512_extracti64x4_epi64
#define _mm512_inserti64x4 simde_mm512_inserti64x4
#define _mm512_castsi256_si512 simde_mm512_castsi256_si512
#define __m512i simde__m512i
#define __m512 simde__m512
#define _mm512_cvtps_epi32 td_simde_mm512_cvtps_epi32
#define _mm512_cvtepi32_ps td_simde_mm512_cvtepi32_ps
#define _mm512_cvtepu8_epi16 td_simde_mm512_cvtepu8_epi16
#define _mm512_cvtusepi32_epi8 td_simde_mm512_cvtusepi32_epi8
#define _mm512_cvtusepi16_epi8 td_simde_mm512_cvtusepi16_epi8
#define _mm512_add_epi32 simde_mm512_add_epi32
#define _mm512_castsi512_si256 simde_mm512_castsi512_si256
#define _mm512_cvtepi8_epi16 simde_mm512_cvtepi8_epi16
#define _mm512_cvtsepi16_epi8 simde_mm512_cvtsepi16_epi8
#define _mm512_cvtsepi32_epi8 simde_mm512_cvtsepi32_epi8
#define _mm512_dpbusd_epi32 simde_mm512_dpbusd_epi32
#define _mm512_loadu_ps simde_mm512_loadu_ps
#define _mm512_loadu_si512 simde_mm512_loadu_si512
#define _mm512_madd_epi16 simde_mm512_madd_epi16
#define _mm512_maddubs_epi16 simde_mm512_maddubs_epi16
#define _mm512_max_ps simde_mm512_max_ps
#define _mm512_min_ps simde_mm512_min_ps
#define _mm512_mul_ps simde_mm512_mul_ps
#define _mm512_packs_epi32 simde_mm512_packs_epi32
#define _mm512_set1_epi16 simde_mm512_set1_epi16
#define _mm512_set1_epi32 simde_mm512_set1_epi32
#define _mm512_set1_ps simde_mm512_set1_ps
#define _mm512_storeu_si512 simde_mm512_storeu_si512
#define _mm512_unpackhi_epi16 simde_mm512_unpackhi_epi16
#define _mm512_unpacklo_epi16 simde_mm512_unpacklo_epi16
/* quantised Add in int32 lanes (qadd_simd.c.j2 I32X) */
#define _mm512_mullo_epi32 simde_mm512_mullo_epi32
#define _mm512_srai_epi32 td_simde_mm512_srai_epi32
#define _mm512_min_epi32 simde_mm512_min_epi32
#define _mm512_max_epi32 simde_mm512_max_epi32
/* 8-bit max pooling (qpool2d_simd.c.j2, avx512bw) */
#define _mm512_max_epu8 simde_mm512_max_epu8
#define _mm512_max_epi8 simde_mm512_max_epi8
#define _mm512_min_epu8 simde_mm512_min_epu8
#define _mm512_min_epi8 simde_mm512_min_epi8
#define _mm512_shuffle_epi8 simde_mm512_shuffle_epi8
#define _mm512_permutex2var_epi64 simde_mm512_permutex2var_epi64
#define _mm512_set1_epi8 simde_mm512_set1_epi8
#define _mm512_set_epi64 simde_mm512_set_epi64
#define _mm512_broadcast_i32x4 simde_mm512_broadcast_i32x4
/* AVX-VNNI's vpdpbusd is AVX512-VNNI's on 256 bits */
#define _mm256_dpbusd_avx_epi32 simde_mm256_dpbusd_epi32
#endif
