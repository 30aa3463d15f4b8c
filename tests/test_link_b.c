/* test_link_b.c - the declarations-only half of test_link_a.c; valid C99 and C++17. */
#include "../ulysses.h"

#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif
int64_t link_b_tokens(int sp_rank);
int64_t link_b_heads(int sp_rank);
#ifdef __cplusplus
}
#endif

static uly_plan link_b_plan(void) {
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = 4;
    d.sp_size = 4;
    d.batch = 1;
    d.seq_len = 10;
    d.n_heads = 5;
    d.head_dim = 8;
    uly_plan p;
    memset(&p, 0, sizeof p);
    if (uly_plan_init(&p, &d).code) p.desc.sp_size = 0;
    return p;
}

int64_t link_b_tokens(int sp_rank) {
    uly_plan p = link_b_plan();
    return p.desc.sp_size ? uly_tokens(&p, sp_rank).count : -1;
}

int64_t link_b_heads(int sp_rank) {
    uly_plan p = link_b_plan();
    return p.desc.sp_size ? uly_heads(&p, sp_rank).count : -1;
}
