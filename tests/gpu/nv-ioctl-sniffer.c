/*
 * nv-ioctl-sniffer: an LD_PRELOAD library that records the ioctls a process issues on NVIDIA
 * device files, decoded far enough to see what gpud's probes must account for: RM_ALLOC classes
 * and video-memory sizes (requested and written back), VID_HEAP_CONTROL functions, RM_FREE,
 * XFER wrappers, and UVM command numbers.
 *
 * Used only on a machine with a real GPU (tests/gpu/real-gpu.sh) to capture what libcuda really
 * issues; it is a measurement tool, not part of gpud. Output: one line per ioctl to the file
 * named by NVSNIFF_OUT (default stderr). Struct offsets are those of gpud-common/src/rm.rs
 * (drivers >= 535); this C file only prints them.
 *
 * Build: gcc -O2 -shared -fPIC -o nv-ioctl-sniffer.so nv-ioctl-sniffer.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>

static int (*real_ioctl)(int, unsigned long, ...);
static FILE *out;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void init(void)
{
	if (!real_ioctl)
		real_ioctl = (int (*)(int, unsigned long, ...))dlsym(RTLD_NEXT, "ioctl");
	if (!out) {
		const char *p = getenv("NVSNIFF_OUT");
		out = p ? fopen(p, "a") : NULL;
		if (!out)
			out = stderr;
		setvbuf(out, NULL, _IOLBF, 0);
	}
}

/* 'c' ctl, 'g' gpu, 'u' uvm, 0 otherwise. */
static char kind_of(int fd)
{
	char link[64], path[256];
	snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
	ssize_t n = readlink(link, path, sizeof path - 1);
	if (n <= 0)
		return 0;
	path[n] = 0;
	if (!strcmp(path, "/dev/nvidiactl"))
		return 'c';
	if (!strncmp(path, "/dev/nvidia-uvm", 15))
		return 'u';
	if (!strncmp(path, "/dev/nvidia", 11) && path[11] >= '0' && path[11] <= '9')
		return 'g';
	return 0;
}

#define U32(p, o) (*(uint32_t *)((char *)(p) + (o)))
#define U64(p, o) (*(uint64_t *)((char *)(p) + (o)))

static void describe_rm(char *buf, size_t len, unsigned nr, unsigned size, void *a, int pre)
{
	buf[0] = 0;
	if (!a)
		return;
	if (nr == 0x2b && (size == 32 || size == 48)) {
		uint32_t cls = U32(a, 12);
		uint64_t pp = U64(a, 16);
		uint32_t st = U32(a, size == 32 ? 28 : 40);
		int n = snprintf(buf, len, "RM_ALLOC%s client=%#x parent=%#x new=%#x class=%#x",
				 size == 32 ? "21" : "64", U32(a, 0), U32(a, 4), U32(a, 8), cls);
		if (size == 48)
			n += snprintf(buf + n, len - n, " flags=%#x", U32(a, 36));
		if ((cls == 0x40 || cls == 0x50a0 || cls == 0x3e) && pp)
			n += snprintf(buf + n, len - n, " mflags=%#x attr=%#x size=%llu", U32((void *)pp, 8),
				      U32((void *)pp, 24), (unsigned long long)U64((void *)pp, 64));
		if (cls == 0x80 && pp)
			n += snprintf(buf + n, len - n, " deviceId=%u", U32((void *)pp, 0));
		if (!pre)
			snprintf(buf + n, len - n, " status=%#x", st);
	} else if (nr == 0x29 && size == 16) {
		snprintf(buf, len, "RM_FREE client=%#x parent=%#x obj=%#x status=%#x", U32(a, 0), U32(a, 4),
			 U32(a, 8), U32(a, 12));
	} else if (nr == 0x4a && size == 184) {
		uint32_t fn = U32(a, 8);
		uint64_t sz = fn == 14 ? U64(a, 80) : U64(a, 88);
		snprintf(buf, len, "VID_HEAP fn=%u client=%#x parent=%#x hMemory=%#x flags=%#x attr=%#x size=%llu status=%#x",
			 fn, U32(a, 0), U32(a, 4), U32(a, 44), U32(a, 52), U32(a, fn == 6 ? 64 : 56),
			 (unsigned long long)sz, U32(a, 20));
	} else if (nr == 0x2a && size == 32) {
		snprintf(buf, len, "RM_CONTROL cmd=%#x status=%#x", U32(a, 8), U32(a, 28));
	} else if (nr == 0x27 && size == 56) {
		snprintf(buf, len, "RM_ALLOC_MEMORY class=%#x flags=%#x limit=%llu status=%#x", U32(a, 12),
			 U32(a, 16), (unsigned long long)U64(a, 32), U32(a, 40));
	} else if (nr == 0x34 && size == 28) {
		snprintf(buf, len, "RM_DUP client=%#x obj=%#x src=%#x:%#x status=%#x", U32(a, 0), U32(a, 8),
			 U32(a, 12), U32(a, 16), U32(a, 24));
	}
}

int ioctl(int fd, unsigned long req, ...)
{
	va_list ap;
	va_start(ap, req);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	init();
	char k = kind_of(fd);
	if (!k)
		return real_ioctl(fd, req, arg);

	unsigned cmd = (unsigned)req;
	unsigned nr = cmd & 0xff, size = (cmd >> 16) & 0x3fff;
	void *inner = arg;
	unsigned inr = nr, isize = size;
	if (k != 'u' && nr == 211 && size == 16 && arg) {
		inr = U32(arg, 0);
		isize = U32(arg, 4);
		inner = (void *)U64(arg, 8);
	}
	char pre[512];
	if (k != 'u')
		describe_rm(pre, sizeof pre, inr, isize, inner, 1);
	int ret = real_ioctl(fd, req, arg);
	char post[512];
	post[0] = 0;
	if (k != 'u')
		describe_rm(post, sizeof post, inr, isize, inner, 0);

	pthread_mutex_lock(&lock);
	if (k == 'u')
		fprintf(out, "%d uvm cmd=%lu ret=%d\n", getpid(), req, ret);
	else
		fprintf(out, "%d %s nr=%#x size=%u%s ret=%d | %s | %s\n", getpid(), k == 'c' ? "ctl" : "gpu",
			inr, isize, inner != arg ? " (xfer)" : "", ret, pre, post);
	pthread_mutex_unlock(&lock);
	return ret;
}
