// nccl_emu.h: the test hooks of tests/emu/nccl_emu.cpp, the in-process NCCL that runs the NCCL
// communicator of ulysses_cuda.cuh under the CUDA emulator (tests only; not part of the product).
// Include after <nccl.h>. `call` names an NCCL function, e.g. "ncclSend"; an unknown name aborts.
#ifndef ULY_NCCL_EMU_H
#define ULY_NCCL_EMU_H

// The next call of `call` on comm returns r, and ncclGetLastError then gives msg. Once; faults
// queue, and one with r = ncclSuccess lets its call through (to fail a later one). `call` takes
// a live communicator: ncclCommSplit, ncclCommCount, ncclCommUserRank, ncclCommGetAsyncError,
// ncclSend, ncclRecv, ncclAlltoAll or ncclAllReduce; another name aborts.
void uly_emu_nccl_fail(ncclComm_t comm, const char *call, ncclResult_t r, const char *msg);

// From now on ncclCommGetAsyncError reports r on comm (ncclRemoteError: a peer died), and NCCL
// refuses new work on it with r; msg becomes the last error when either happens.
void uly_emu_nccl_async_error(ncclComm_t comm, ncclResult_t r, const char *msg);

// From now on every call on comm that answers ncclInProgress (a non-blocking communicator's)
// stays in progress, as when a peer never arrives.
void uly_emu_nccl_stall(ncclComm_t comm);

// The next ncclAllReduce or ncclAlltoAll on comm keeps its stream busy for ms milliseconds after
// it has moved the data, as a GPU's collective kernel waits for a peer that comes late.
void uly_emu_nccl_late(ncclComm_t comm, long ms);

// Whether ncclCommAbort was called on comm. The double keeps every communicator it made, so this
// may ask about an aborted one; any NCCL call on it aborts the test instead.
bool uly_emu_nccl_aborted(ncclComm_t comm);

// From now on ncclGetVersion reports code (NCCL_VERSION(major, minor, patch)).
void uly_emu_nccl_version(int code);

// How many times any thread called `call` since the process started.
unsigned long long uly_emu_nccl_calls(const char *call);

#endif
