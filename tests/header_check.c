/* header_check.c - ulysses.h with its implementation must compile cleanly as C99 and as C++17,
   with gcc and with clang, under -Wall -Wextra -Wpedantic -Werror (make test builds this file
   every way; see the foundation section of the Makefile). Nothing here runs. */
#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"

/* A caller's view: the descriptor zero-initialized, a few fields set. */
int header_check_plan(int rank);
int header_check_plan(int rank) {
    uly_plan_desc d;
    uly_plan p;
    char *z = (char *)&d;
    for (size_t i = 0; i < sizeof d; i++) z[i] = 0;
    d.world_size = 4;
    d.rank = rank;
    d.sp_size = 4;
    d.batch = 1;
    d.seq_len = 64;
    d.n_heads = 8;
    d.head_dim = 64;
    return (int)uly_plan_init(&p, &d).code;
}
