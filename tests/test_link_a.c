/* test_link_a.c - with test_link_b.c: two translation units include ulysses.h, this one with
   the implementation (twice), the other for declarations only, and they link into one program
   (no duplicate or missing symbols). test_link_b.c is also built as C++ to check extern "C". */
#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"
#include "../ulysses.h" /* again, as a file that also includes ulysses_cuda.cuh does */
#include "check.h"

int64_t link_b_tokens(int sp_rank); /* in test_link_b.c: uly_tokens count of a fixed plan */
int64_t link_b_heads(int sp_rank);

TEST(a_translation_unit_without_the_implementation_calls_the_one_that_has_it) {
    /* S = 10, H = 5 over P = 4: tokens 3,3,2,2 and heads 2,1,1,1 */
    CHECK(link_b_tokens(0) == 3 && link_b_tokens(3) == 2, "tokens %lld %lld",
          (long long)link_b_tokens(0), (long long)link_b_tokens(3));
    CHECK(link_b_heads(0) == 2 && link_b_heads(1) == 1, "heads %lld %lld",
          (long long)link_b_heads(0), (long long)link_b_heads(1));
}

int main(void) { return uly_run_tests(); }
