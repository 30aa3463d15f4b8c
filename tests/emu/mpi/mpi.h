/* mpi.h of tests/emu/mpi_emu.cpp: MPI ranks as threads of one process (tests only; not part of
   the product). A program that includes <mpi.h> with tests/emu/mpi on its include path, built
   with -Dmain=mpi_emu_main and linked with mpi_emu.cpp, runs as `program -np N args...`. It
   declares only what examples/sp_attention_nccl.cu calls: anything else fails to compile. */
#ifndef ULY_MPI_EMU_H
#define ULY_MPI_EMU_H

#ifdef __cplusplus
extern "C" {
#endif

typedef int MPI_Comm;
typedef int MPI_Datatype;
typedef int MPI_Op;
typedef int MPI_Info;

#define MPI_COMM_NULL 0
#define MPI_COMM_WORLD 1
#define MPI_COMM_TYPE_SHARED 1
#define MPI_INFO_NULL 0
#define MPI_BYTE 1
#define MPI_INT 2
#define MPI_MAX 1
#define MPI_SUM 2
#define MPI_SUCCESS 0

int MPI_Init(int *argc, char ***argv);
int MPI_Finalize(void);
int MPI_Comm_rank(MPI_Comm comm, int *rank);
int MPI_Comm_size(MPI_Comm comm, int *size);
/* Every rank is on one node: the shared split is a copy of the world. */
int MPI_Comm_split_type(MPI_Comm comm, int split_type, int key, MPI_Info info, MPI_Comm *out);
int MPI_Comm_free(MPI_Comm *comm);
int MPI_Bcast(void *buf, int count, MPI_Datatype type, int root, MPI_Comm comm);
int MPI_Allreduce(const void *send, void *recv, int count, MPI_Datatype type, MPI_Op op,
                  MPI_Comm comm);
int MPI_Abort(MPI_Comm comm, int code);

/* The program's main, renamed by -Dmain=mpi_emu_main: mpi_emu.cpp's main runs it once a rank. */
int mpi_emu_main(int argc, char **argv);

#ifdef __cplusplus
}
#endif

#endif
