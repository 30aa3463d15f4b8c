/* test_static_b.c - the second private copy for test_static_a.c. */
#define ULYSSES_STATIC
#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"

#include <string.h>

int64_t static_b_kv_heads(int sp_rank);
int64_t static_b_kv_heads(int sp_rank) {
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = 4, d.sp_size = 4, d.batch = 1, d.seq_len = 8, d.n_heads = 8;
    d.n_kv_heads = 2, d.head_dim = 8;
    uly_plan p;
    if (uly_plan_init(&p, &d).code) return -1;
    return uly_kv_heads(&p, sp_rank).start;
}
