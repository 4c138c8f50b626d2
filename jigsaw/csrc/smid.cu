// SM-id census: every block of the grid records the SM (%smid) it ran on.
//
//   torch.ops.jigsaw_smid.record(out, spin_ns)      out: int32 CUDA tensor, one entry per block
//       -> grid of out.numel() blocks on the CURRENT torch CUDA stream of out's device
//       -> each block busy-waits ~spin_ns (clock64), then thread 0 writes %smid to out[block]
//
// jigsaw.mux.partition.smid builds this file with torch.utils.cpp_extension.load on first use and
// compares the set of ids a green-context stream produced against its partition's SM count.
// Launching on the current stream (not a stream of our own) is the point: the caller picks
// the green stream with `torch.cuda.stream(...)`, and the ids show where that stream's work ran.

#include <cstdint>
#include <limits>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // what at::cuda::getCurrentCUDAStream is, without ATen/cuda/CUDAContext.h's
                                  // cuBLAS/cuSPARSE headers (a bare CUDA toolkit may lack them)
#include <cuda_runtime.h>
#include <torch/library.h>

namespace {

// 1024-thread blocks fit at most two to an SM (2048 threads per SM on Ampere/Hopper), so a grid
// of a few blocks per SM cannot pile onto a handful of SMs: it has to spread over every SM the
// stream may use, which is what makes an unconfined stream show more ids than its partition.
constexpr int kThreadsPerBlock = 1024;

__device__ __forceinline__ unsigned int sm_id() {
  unsigned int id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

__global__ void record_smid_kernel(int32_t* out, long long spin_cycles) {
  // The spin keeps each block resident long enough that later blocks must go to other SMs
  // (without it a tiny grid could finish on the first few SMs the scheduler hands out).
  const long long start = clock64();
  while (clock64() - start < spin_cycles) {
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // Read after the spin: the SM the block finished on (blocks do not migrate in practice).
    out[blockIdx.x] = static_cast<int32_t>(sm_id());
  }
}

long long spin_cycles_of(int64_t spin_ns, int device) {
  int clock_khz = 0;  // peak SM clock; at a lower actual clock the wait only gets longer
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  return static_cast<long long>(spin_ns) * clock_khz / 1000000;  // ns * kHz * 1e-6 = cycles
}

void record(at::Tensor& out, int64_t spin_ns) {
  TORCH_CHECK(out.is_cuda(), "jigsaw_smid.record: out must be a CUDA tensor, got ", out.device());
  TORCH_CHECK(out.scalar_type() == at::kInt, "jigsaw_smid.record: out must be int32, got ", out.scalar_type());
  TORCH_CHECK(out.is_contiguous(), "jigsaw_smid.record: out must be contiguous");
  TORCH_CHECK(out.numel() > 0, "jigsaw_smid.record: out must have at least one entry (one per block)");
  TORCH_CHECK(out.numel() <= std::numeric_limits<int32_t>::max(), "jigsaw_smid.record: too many blocks: ",
              out.numel());
  TORCH_CHECK(spin_ns >= 0, "jigsaw_smid.record: spin_ns must be >= 0, got ", spin_ns);

  const c10::cuda::CUDAGuard guard(out.device());
  const long long spin_cycles = spin_cycles_of(spin_ns, out.device().index());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  const auto num_blocks = static_cast<unsigned int>(out.numel());
  record_smid_kernel<<<num_blocks, kThreadsPerBlock, 0, stream>>>(out.data_ptr<int32_t>(), spin_cycles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(jigsaw_smid, m) {
  m.def("record(Tensor(a!) out, int spin_ns) -> ()");
}

TORCH_LIBRARY_IMPL(jigsaw_smid, CUDA, m) {
  m.impl("record", &record);
}
