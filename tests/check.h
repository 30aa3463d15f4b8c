/* check.h - the smallest test framework that reads like a specification.

   TEST(name) { CHECK(x == 1, "x is %d", x); }      defines and registers a test
   int main(void) { return uly_run_tests(); }       runs them in order

   Each test prints one line, "ok   name" or "FAIL name" followed by the failed checks; the last
   line is "N passed, M failed", which Makefile's summary adds up over all test programs.
   Works in C99 and C++ (the emulated CUDA tests are C++). Registration uses a constructor
   attribute so tests need no hand-kept list. */
#ifndef ULY_CHECK_H
#define ULY_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void (*uly_test_fn)(void);
typedef struct { const char *name; uly_test_fn fn; } uly_test_entry;

enum { ULY_MAX_TESTS = 1024 };
static uly_test_entry uly_tests[ULY_MAX_TESTS];
static int uly_ntests;
static int uly_test_failed; /* checks failed in the running test */
static const char *uly_current_test = "";

static void uly_register_test(const char *name, uly_test_fn fn) {
    if (uly_ntests < ULY_MAX_TESTS) {
        uly_tests[uly_ntests].name = name;
        uly_tests[uly_ntests].fn = fn;
        uly_ntests++;
    }
}

#define TEST(name)                                                                     \
    static void test_##name(void);                                                     \
    __attribute__((constructor)) static void register_##name(void) {                   \
        uly_register_test(#name, test_##name);                                         \
    }                                                                                  \
    static void test_##name(void)

/* A failed check reports and lets the test go on, so one run shows every broken case. */
#define CHECK(cond, ...)                                                               \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            if (!uly_test_failed) printf("FAIL %s\n", uly_current_test);              \
            uly_test_failed++;                                                         \
            if (uly_test_failed <= 10) {                                               \
                printf("     %s:%d: %s: ", __FILE__, __LINE__, #cond);                \
                printf(__VA_ARGS__);                                                   \
                printf("\n");                                                          \
            }                                                                          \
        }                                                                              \
    } while (0)

/* |got - want| <= tol, and NaN is never close to anything. */
#define CHECK_NEAR(got, want, tol, what)                                               \
    CHECK(fabs((double)(got) - (double)(want)) <= (tol), "%s: got %.9g want %.9g (tol %g)", \
          (what), (double)(got), (double)(want), (double)(tol))

/* Whether name contains the word, of n characters. */
static int uly_test_has(const char *name, const char *w, size_t n) {
    for (const char *p = name; strlen(p) >= n; p++)
        if (strncmp(p, w, n) == 0) return 1;
    return 0;
}

/* Whether filter, comma-separated words, selects name: a word that starts with '-' excludes the
   tests that contain the rest of it; the others select the tests that contain them, and when
   there are none every test not excluded is selected. */
static int uly_test_selected(const char *name, const char *filter) {
    int wanted = 0, any_wanted = 0;
    for (const char *w = filter;;) {
        const char *end = strchr(w, ',');
        const size_t n = end ? (size_t)(end - w) : strlen(w);
        if (*w == '-') {
            if (uly_test_has(name, w + 1, n - 1)) return 0;
        } else {
            any_wanted = 1;
            wanted |= uly_test_has(name, w, n);
        }
        if (!end) return wanted || !any_wanted;
        w = end + 1;
    }
}

/* Runs every test, or those ULY_TEST_FILTER selects (ULY_TEST_FILTER=d128,masked: the tests
   whose name contains d128 or masked; ULY_TEST_FILTER=-d128: all but those with d128). */
static int uly_run_tests(void) {
    const char *filter = getenv("ULY_TEST_FILTER");
    int passed = 0, failed = 0;
    for (int i = 0; i < uly_ntests; i++) {
        if (filter && !uly_test_selected(uly_tests[i].name, filter)) continue;
        uly_current_test = uly_tests[i].name;
        uly_test_failed = 0;
        uly_tests[i].fn();
        if (uly_test_failed) {
            if (uly_test_failed > 10) printf("     ... %d failed checks in all\n", uly_test_failed);
            failed++;
        } else {
            printf("ok   %s\n", uly_tests[i].name);
            passed++;
        }
        fflush(stdout);
    }
    if (filter && passed + failed == 0) { /* a misspelt filter must not read as a pass */
        printf("FAIL ULY_TEST_FILTER=%s selects no test\n", filter);
        failed = 1;
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}

#endif
