// What the CUDA libraries share: the CUDA headers (or, with PA_CUDA_HOST_EMULATION, the host
// emulation of them that tests use), the launch macro, and the library's last error. Each
// .cu file is its own library, so each has its own copy of the error.
#pragma once

#ifdef PA_CUDA_HOST_EMULATION  // tests run the kernels on the host: see host_emulation.h
#include "host_emulation.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define PA_LAUNCH(kernel, grid, block, stream, ...) kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
#endif

#include <string>

namespace {

thread_local std::string g_last_error;

int fail(const std::string& message) {
    g_last_error = message;
    return 1;
}

// Every launch is followed by this: a launch error becomes the call's error.
int check_launch(const char* what) {
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return fail(std::string(what) + ": " + cudaGetErrorString(err));
    return 0;
}

}  // namespace
