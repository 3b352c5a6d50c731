// A GPU tenant whose progress another process can read, for tests/gpu/hw-controls.sh (built there
// with nvcc; measurement tooling, not part of gpud).
//
//   hw_tenant MODE SECS [ARG]
//
// Every kernel does a fixed amount of integer work (calibrated at start to KERNEL_MS alone on
// the GPU), so a tenant held off the GPU makes no progress however long it waits. When a
// kernel's last block ends it writes the kernel's number into pinned host memory, which gpud's
// measurement tool (gpud-hwcontrols) reads from outside with process_vm_readv: progress as the
// GPU sees it, without NVML. MODE:
//   sync  10 kernels, then a synchronize, in a loop (the matmul loop's queue shape);
//   deep  about ARG (default 1024) kernels kept queued, never synchronized;
//   gated sync, once the word at `gate` (written by the tool) is 1, until it is 2;
//   lc    requests of ARG kernels (default 1) at Poisson arrivals making LC_LOAD (0.3) of the GPU
//         busy alone (LC_KERNEL_US: a kernel's time alone, else as timed at start), each
//         synchronized; each request's latency to LC_OUT (arrival, µs);
//   calibrate  only the READY line (ITERATIONS for KERNEL_MS alone), then exit.
// ITERATIONS fixes the work per kernel instead of timing it (tenants started beside others);
// WAVES spreads it over that many times more, shorter blocks.
// Prints `READY pid=… progress=0x… gate=0x… kernel_us=…` once calibrated, one JSON line per
// second (kernels completed), and at the end `CHECK ok|FAILED …`: every completed kernel's
// results are verified (per-thread results against the CPU for a sample; the sum over all
// kernels against kernels × one kernel's sum), so a control that broke work shows.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <unistd.h>

#define CK(x)                                                                                  \
	do {                                                                                   \
		cudaError_t e_ = (x);                                                          \
		if (e_ != cudaSuccess) {                                                       \
			printf("CUDA_ERROR %s at %s:%d: %s\n", #x, __FILE__, __LINE__,         \
			       cudaGetErrorString(e_));                                        \
			fflush(stdout);                                                        \
			exit(3);                                                               \
		}                                                                              \
	} while (0)

static const int THREADS = 256;

__host__ __device__ inline uint32_t step(uint32_t x, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++) {
		x ^= x >> 13;
		x = x * 1664525u + 1013904223u;
	}
	return x;
}

__global__ void work(uint32_t n, uint32_t *out, unsigned long long *total, unsigned int *blocks_done,
		     volatile unsigned long long *progress, unsigned long long index)
{
	uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
	uint32_t x = step(tid * 2654435761u + 1u, n);
	out[tid] = x;
	unsigned long long s = x;
	for (int o = 16; o > 0; o >>= 1)
		s += __shfl_down_sync(0xffffffffu, s, o);
	if ((threadIdx.x & 31) == 0)
		atomicAdd(total, s);
	__syncthreads();
	if (threadIdx.x == 0) {
		__threadfence();
		unsigned int t = atomicAdd(blocks_done, 1u);
		if (t == gridDim.x - 1) {
			*blocks_done = 0;
			*progress = index + 1;
			__threadfence_system();
		}
	}
}

static double now_s()
{
	using namespace std::chrono;
	return duration<double>(system_clock::now().time_since_epoch()).count();
}

struct Tenant {
	int blocks = 0;
	uint32_t n = 0;
	uint32_t *out = nullptr;
	unsigned long long *total = nullptr;
	unsigned int *blocks_done = nullptr;
	volatile unsigned long long *progress_host = nullptr;
	unsigned long long *progress_dev = nullptr;
	unsigned long long launched = 0;
	cudaStream_t stream{};

	void launch()
	{
		work<<<blocks, THREADS, 0, stream>>>(n, out, total, blocks_done, progress_dev, launched);
		CK(cudaGetLastError());
		launched++;
	}
	unsigned long long done() const { return *progress_host; }
};

// Kernel time alone on the GPU (ms) with `n` iterations.
static double time_kernel(Tenant &t, uint32_t n, int reps)
{
	cudaEvent_t a, b;
	CK(cudaEventCreate(&a));
	CK(cudaEventCreate(&b));
	t.n = n;
	t.launch();
	CK(cudaEventRecord(a, t.stream));
	for (int i = 0; i < reps; i++)
		t.launch();
	CK(cudaEventRecord(b, t.stream));
	CK(cudaEventSynchronize(b));
	float ms = 0;
	CK(cudaEventElapsedTime(&ms, a, b));
	cudaEventDestroy(a);
	cudaEventDestroy(b);
	return ms / reps;
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: hw_tenant sync|deep|gated|lc SECS [ARG]\n");
		return 2;
	}
	const char *mode = argv[1];
	double secs = atof(argv[2]);
	long arg = argc > 3 ? atol(argv[3]) : 0;
	double kernel_ms = getenv("KERNEL_MS") ? atof(getenv("KERNEL_MS")) : 2.0;
	static volatile unsigned long long gate = 0;

	Tenant t;
	int dev = 0, sms = 0;
	CK(cudaSetDevice(dev));
	CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
	// WAVES: the same work per kernel in WAVES times as many blocks, each that much shorter
	// (how long a block runs bounds how soon the GPU can switch away from the kernel).
	int waves = getenv("WAVES") ? std::max(1, atoi(getenv("WAVES"))) : 1;
	t.blocks = sms * 8 * waves;
	size_t threads = (size_t)t.blocks * THREADS;
	CK(cudaStreamCreateWithFlags(&t.stream, cudaStreamNonBlocking));
	CK(cudaMalloc((void **)&t.out, threads * sizeof(uint32_t)));
	CK(cudaMalloc((void **)&t.total, sizeof(unsigned long long)));
	CK(cudaMalloc((void **)&t.blocks_done, sizeof(unsigned int)));
	CK(cudaMemsetAsync(t.total, 0, sizeof(unsigned long long), t.stream));
	CK(cudaMemsetAsync(t.blocks_done, 0, sizeof(unsigned int), t.stream));
	unsigned long long *ph = nullptr;
	CK(cudaHostAlloc((void **)&ph, sizeof(unsigned long long), cudaHostAllocMapped));
	*ph = 0;
	t.progress_host = ph;
	CK(cudaHostGetDevicePointer((void **)&t.progress_dev, (void *)ph, 0));
	CK(cudaStreamSynchronize(t.stream));

	// Calibrate: iterations for kernel_ms alone, unless ITERATIONS fixes them (so that tenants
	// started beside others do the same work per kernel as one calibrated alone).
	uint32_t n = getenv("ITERATIONS") ? (uint32_t)(atol(getenv("ITERATIONS")) / waves) : 0;
	double ms;
	if (n == 0) {
		ms = time_kernel(t, 20000, 5);
		n = (uint32_t)std::max(1000.0, 20000.0 * kernel_ms / std::max(ms, 1e-3));
		ms = time_kernel(t, n, 10);
		n = (uint32_t)std::max(1000.0, n * kernel_ms / std::max(ms, 1e-3));
	}
	ms = time_kernel(t, n, 20);
	t.n = n;
	CK(cudaStreamSynchronize(t.stream));
	// Verification counts from here: reset the sum and the progress.
	CK(cudaMemsetAsync(t.total, 0, sizeof(unsigned long long), t.stream));
	CK(cudaStreamSynchronize(t.stream));
	t.launched = 0;
	*ph = 0;
	printf("READY pid=%d progress=%p gate=%p kernel_us=%.0f iterations=%u blocks=%d mode=%s\n", getpid(),
	       (void *)ph, (void *)&gate, ms * 1000, n, t.blocks, mode);
	fflush(stdout);

	std::atomic<bool> stop{false};
	std::thread ticker([&] {
		unsigned long long last = 0;
		double tick = now_s();
		while (!stop.load()) {
			std::this_thread::sleep_for(std::chrono::milliseconds(1000));
			unsigned long long d = t.done();
			double now = now_s();
			printf("{\"t\": %.3f, \"pid\": %d, \"mode\": \"%s\", \"kernels_per_s\": %.1f}\n", now, getpid(),
			       mode, (d - last) / (now - tick));
			fflush(stdout);
			last = d;
			tick = now;
		}
	});

	double end = now_s() + secs;
	if (!strcmp(mode, "calibrate")) {
		end = 0;
	} else if (!strcmp(mode, "sync") || !strcmp(mode, "gated")) {
		bool gated = !strcmp(mode, "gated");
		while (gated && gate == 0 && now_s() < end)
			usleep(200);
		while (now_s() < end && !(gated && gate >= 2)) {
			for (int i = 0; i < 10; i++)
				t.launch();
			CK(cudaStreamSynchronize(t.stream));
		}
	} else if (!strcmp(mode, "deep")) {
		unsigned long long depth = arg > 0 ? arg : 1024;
		while (now_s() < end) {
			if (t.launched - t.done() < depth)
				t.launch();
			else
				usleep(100);
		}
	} else if (!strcmp(mode, "lc")) {
		long k = arg > 0 ? arg : 1;
		double load = getenv("LC_LOAD") ? atof(getenv("LC_LOAD")) : 0.3;
		double kernel_s = getenv("LC_KERNEL_US") ? atof(getenv("LC_KERNEL_US")) / 1e6 : ms / 1000.0;
		double service = k * kernel_s;
		std::mt19937_64 rng(12345);
		std::exponential_distribution<double> gap(load / service);
		FILE *lat = fopen(getenv("LC_OUT") ? getenv("LC_OUT") : "/dev/null", "w");
		double arrival = now_s();
		while (true) {
			arrival += gap(rng);
			if (arrival >= end)
				break;
			double wait = arrival - now_s();
			if (wait > 0)
				usleep((useconds_t)(wait * 1e6));
			for (long i = 0; i < k; i++)
				t.launch();
			CK(cudaStreamSynchronize(t.stream));
			fprintf(lat, "%.6f %.1f\n", arrival, (now_s() - arrival) * 1e6);
		}
		fclose(lat);
	} else {
		fprintf(stderr, "unknown mode %s\n", mode);
		return 2;
	}
	CK(cudaStreamSynchronize(t.stream));
	stop = true;
	ticker.join();

	// Verify: a sample of threads against the CPU, and the sum of all kernels.
	unsigned long long kernels = t.done();
	std::vector<uint32_t> out(threads);
	unsigned long long total = 0;
	CK(cudaMemcpy(out.data(), t.out, threads * sizeof(uint32_t), cudaMemcpyDeviceToHost));
	CK(cudaMemcpy(&total, t.total, sizeof total, cudaMemcpyDeviceToHost));
	unsigned long long one = 0;
	for (uint32_t v : out)
		one += v;
	size_t bad = 0;
	for (size_t i = 0; i < threads; i += threads / 64)
		if (out[i] != step((uint32_t)i * 2654435761u + 1u, n))
			bad++;
	bool ok = bad == 0 && kernels == t.launched && total == kernels * one;
	printf("CHECK %s kernels=%llu launched=%llu sampled_mismatches=%zu sum_matches=%d\n", ok ? "ok" : "FAILED",
	       kernels, t.launched, bad, (int)(total == kernels * one));
	fflush(stdout);
	return ok ? 0 : 1;
}
