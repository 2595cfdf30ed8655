/* What the library says about itself: the loader's staleness check and the
 * backend report of `quantobs info` (see qo_kernels.h). */
#include "qo_kernels.h"

/* The build passes the hash of the C sources as a bare token
 * (-DQO_SOURCE_HASH=0123abcd...: no quotes to survive a command line). */
#ifndef QO_SOURCE_HASH
#define QO_SOURCE_HASH unknown
#endif

#ifdef _OPENMP
#define QO_OPENMP QO_STR(_OPENMP)
#else
#define QO_OPENMP "0"
#endif

#if defined(__clang__)
#define QO_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#define QO_COMPILER "gcc " __VERSION__
#elif defined(_MSC_VER)
#define QO_COMPILER "msvc " QO_STR(_MSC_VER)
#else
#define QO_COMPILER "unknown"
#endif

const char *qo_source_hash(void) { return QO_STR(QO_SOURCE_HASH); }

const char *qo_build_info(void) {
    return "openmp=" QO_OPENMP ";clones=" QO_CLONE_TARGETS ";compiler=" QO_COMPILER;
}

/* The clone the ifunc resolvers chose: the first target of QO_CLONES that
 * this CPU supports (the resolvers test the same CPU feature bits). */
const char *qo_isa(void) {
#if QO_HAS_CLONES
    __builtin_cpu_init();
    /* the MSE scorers' and symmetric scales' widest clone; the others' is
     * avx2 */
    if (__builtin_cpu_supports(QO_WIDE_ISA)) return QO_WIDE_ISA;
    if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
    return "default";
}
