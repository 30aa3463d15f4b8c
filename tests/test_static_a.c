/* test_static_a.c - with test_static_b.c: two translation units each embed a private copy of
   the implementation (ULYSSES_STATIC) and link into one program without clashing. */
#define ULYSSES_STATIC
#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"
#include "check.h"

int64_t static_b_kv_heads(int sp_rank); /* in test_static_b.c, from its own copy */

TEST(two_static_copies_of_the_implementation_link_and_agree) {
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = 4, d.sp_size = 4, d.batch = 1, d.seq_len = 8, d.n_heads = 8;
    d.n_kv_heads = 2, d.head_dim = 8;
    uly_plan p;
    uly_status st = uly_plan_init(&p, &d);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    for (int r = 0; r < 4; r++) /* heads [2r, 2r + 2) of groups of 4: kv head r / 2 */
        CHECK(uly_kv_heads(&p, r).start == r / 2 && static_b_kv_heads(r) == r / 2,
              "rank %d: %lld here, %lld there, want %d", r,
              (long long)uly_kv_heads(&p, r).start, (long long)static_b_kv_heads(r), r / 2);
}

int main(void) { return uly_run_tests(); }
