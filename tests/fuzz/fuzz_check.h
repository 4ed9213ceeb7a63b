// FUZZ_CHECK(cond): a fuzz target's assertion. Unlike assert() it stays on in every build type,
// and it aborts with the file, line and condition, so libFuzzer saves the input as a crash.
#ifndef RANKSCOPE_TESTS_FUZZ_FUZZ_CHECK_H_
#define RANKSCOPE_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond)                                                            \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                 \
    }                                                                               \
  } while (0)

#endif  // RANKSCOPE_TESTS_FUZZ_FUZZ_CHECK_H_
