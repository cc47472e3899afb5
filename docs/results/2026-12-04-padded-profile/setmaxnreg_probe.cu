// ptxas (CUDA 13.0, here on the CPU: nvcc -arch=sm_90a -cubin -Xptxas -v setmaxnreg_probe.cu): does code get the
// register count of a setmaxnreg.inc that runs in a branch of its own (as in the Mosaic cache half) or only one that
// dominates it? 200 live floats a thread, 384 threads (168 registers at launch). Output: setmaxnreg_probe_ptxas.txt.
__device__ __forceinline__ void reg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory"); }
__device__ __forceinline__ void reg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void heavy(float* out, const float* in) {
  float r[N];
#pragma unroll
  for (int i = 0; i < N; i++) r[i] = in[threadIdx.x + i * 512];
#pragma unroll 1
  for (int it = 0; it < 100; it++) {
#pragma unroll
    for (int i = 0; i < N; i++) r[i] = r[i] * r[(i + 1) % N] + r[(i + 7) % N];
  }
  float s = 0;
#pragma unroll
  for (int i = 0; i < N; i++) s += r[i] * (i + 1);
  out[threadIdx.x] = s;
}

// setmaxnreg in a block of its own, the heavy code in another block (what the Mosaic kernel does now)
extern "C" __global__ void __launch_bounds__(384, 1) separate(float* out, const float* in) {
  int wg = threadIdx.x / 128;
  if (wg < 2) reg_inc();
  if (wg == 2) reg_dec();
  if (wg < 2) heavy<200>(out, in);
}

// setmaxnreg at the head of the branch that runs the heavy code
extern "C" __global__ void __launch_bounds__(384, 1) dominating(float* out, const float* in) {
  int wg = threadIdx.x / 128;
  if (wg < 2) {
    reg_inc();
    heavy<200>(out, in);
  } else {
    reg_dec();
  }
}

// no setmaxnreg at all
extern "C" __global__ void __launch_bounds__(384, 1) none(float* out, const float* in) {
  int wg = threadIdx.x / 128;
  if (wg < 2) heavy<200>(out, in);
}
