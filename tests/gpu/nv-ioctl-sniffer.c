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
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>

static int (*real_ioctl)(int, unsigned long, ...);
int ioctl(int fd, unsigned long req, ...);
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

/* RM_CONTROL (NVOS54): client@0 object@4 cmd@8 params@16 paramsSize@24 status@28. After the
 * call, the replies that tell memory sizes are decoded (the FB info lists as index=data, in KiB;
 * UGPU_MEMORY_INFO in bytes) and any other reply's first 32 bytes are printed in hex, so that what
 * CUDA, NVML and nvidia-smi ask for and get can be read from the log. */
static void describe_control(char *buf, size_t len, void *a, int pre)
{
	uint32_t cmd = U32(a, 8), psize = U32(a, 24);
	void *p = (void *)U64(a, 16);
	int n = snprintf(buf, len, "RM_CONTROL client=%#x obj=%#x cmd=%#x psize=%u", U32(a, 0), U32(a, 4),
			 cmd, psize);
	if (pre || !p)
		return;
	n += snprintf(buf + n, len - n, " status=%#x", U32(a, 28));
	if (cmd == 0x20801303 && psize >= 12) { /* FB_GET_INFO_V2: list inline at +4 */
		uint32_t cnt = U32(p, 0), cap = (psize - 4) / 8;
		n += snprintf(buf + n, len - n, " fbinfo_v2[%u]", cnt);
		for (uint32_t i = 0; i < cnt && i < cap && i < 64 && n < (int)len - 24; i++)
			n += snprintf(buf + n, len - n, " %#x=%u", U32(p, 4 + 8 * i), U32(p, 8 + 8 * i));
	} else if (cmd == 0x20801301 && psize == 16 && U64(p, 8)) { /* V1: list behind a pointer */
		uint32_t cnt = U32(p, 0);
		void *l = (void *)U64(p, 8);
		n += snprintf(buf + n, len - n, " fbinfo_v1[%u]", cnt);
		for (uint32_t i = 0; i < cnt && i < 64 && n < (int)len - 24; i++)
			n += snprintf(buf + n, len - n, " %#x=%u", U32(l, 8 * i), U32(l, 4 + 8 * i));
	} else if (cmd == 0x20801362 && psize == 48) {
		snprintf(buf + n, len - n, " ugpu total=%llu free=%llu [%llu %llu] [%llu %llu]",
			 (unsigned long long)U64(p, 0), (unsigned long long)U64(p, 8),
			 (unsigned long long)U64(p, 16), (unsigned long long)U64(p, 24),
			 (unsigned long long)U64(p, 32), (unsigned long long)U64(p, 40));
	} else {
		n += snprintf(buf + n, len - n, " reply");
		for (uint32_t i = 0; i < psize && i < 32 && n < (int)len - 4; i++)
			n += snprintf(buf + n, len - n, "%s%02x", i % 4 ? "" : " ", ((uint8_t *)p)[i]);
	}
}

/* NVSNIFF_VIEW=LIMIT:USAGE (bytes) applies gpud's memory-view rule to the memory replies in user
 * space, after the driver answered: the totals become min(total, LIMIT) and the free figures
 * min(free, LIMIT - USAGE). It shows what CUDA, NVML and nvidia-smi make of such a reply on a
 * machine whose kernel refuses bpf_probe_write_user (docs/real-gpu.md). */
static void apply_view(void *a)
{
	const char *v = getenv("NVSNIFF_VIEW");
	void *p = (void *)U64(a, 16);
	uint32_t cmd = U32(a, 8), psize = U32(a, 24);
	if (!v || !p || U32(a, 28))
		return;
	char *end;
	uint64_t limit = strtoull(v, &end, 0), usage = *end == ':' ? strtoull(end + 1, NULL, 0) : 0;
	uint64_t freeb = limit > usage ? limit - usage : 0;
	uint32_t lk = limit >> 10 > 0xffffffffULL ? 0xffffffffU : (uint32_t)(limit >> 10);
	uint32_t fk = freeb >> 10 > 0xffffffffULL ? 0xffffffffU : (uint32_t)(freeb >> 10);
	void *list = NULL;
	uint32_t n = 0;
	if (cmd == 0x20801303 && psize >= 12) {
		list = (char *)p + 4;
		n = U32(p, 0) < (psize - 4) / 8 ? U32(p, 0) : (psize - 4) / 8;
	} else if (cmd == 0x20801301 && psize == 16) {
		list = (void *)U64(p, 8);
		n = U32(p, 0) < 128 ? U32(p, 0) : 128;
	} else if (cmd == 0x20801362 && psize == 48) {
		for (int i = 0; i < 6; i++) {
			uint64_t cap = (i == 0 || i == 2 || i == 3) ? limit : freeb;
			if (U64(p, 8 * i) > cap)
				U64(p, 8 * i) = cap;
		}
	}
	for (uint32_t i = 0; list && i < n; i++) {
		uint32_t idx = U32(list, 8 * i), *d = &U32(list, 8 * i + 4);
		uint32_t cap = (idx == 0x7 || idx == 0x8 || idx == 0x9 || idx == 0xa || idx == 0x20) ? lk
			       : (idx == 0x16 || idx == 0x12)					   ? fk
												   : 0xffffffffU;
		if (*d > cap)
			*d = cap;
	}
}

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
		if (fn == 5 && !pre)
			snprintf(buf + strlen(buf), len - strlen(buf), " total=%llu free=%llu",
				 (unsigned long long)U64(a, 24), (unsigned long long)U64(a, 32));
	} else if (nr == 0x2a && size == 32) {
		describe_control(buf, len, a, pre);
	} else if (nr == 0x27 && size == 56) {
		snprintf(buf, len, "RM_ALLOC_MEMORY class=%#x flags=%#x limit=%llu status=%#x", U32(a, 12),
			 U32(a, 16), (unsigned long long)U64(a, 32), U32(a, 40));
	} else if (nr == 0x34 && size == 28) {
		snprintf(buf, len, "RM_DUP client=%#x obj=%#x src=%#x:%#x status=%#x", U32(a, 0), U32(a, 8),
			 U32(a, 12), U32(a, 16), U32(a, 24));
	}
}

/* Is cmd named in the comma-separated list of hex commands in the environment variable? */
static int listed(const char *var, uint32_t cmd)
{
	const char *v = getenv(var);
	while (v && *v) {
		char *end;
		unsigned long c = strtoul(v, &end, 16);
		if (end == v)
			break;
		if ((uint32_t)c == cmd)
			return 1;
		v = *end == ',' ? end + 1 : end;
	}
	return 0;
}

/* Which control-file descriptor each RM client was allocated on, so that a test can issue
 * controls as the process's own CUDA client (nvsniff_control). */
static struct { uint32_t client; int fd; } clients[64];

static void remember(uint32_t client, int fd)
{
	for (int i = 0; i < 64; i++) {
		if (clients[i].client == client || !clients[i].client) {
			clients[i].client = client;
			clients[i].fd = fd;
			return;
		}
	}
}

/* Writes a marker line into the log (called through ctypes by the test programs). */
void nvsniff_mark(const char *what)
{
	init();
	pthread_mutex_lock(&lock);
	fprintf(out, "%d MARK %s\n", getpid(), what);
	pthread_mutex_unlock(&lock);
}

/* Issues RM control cmd on (client, object) through the fd that client was allocated on, via
 * this library's own ioctl (so it is logged). Returns the RM status, or -errno when the ioctl
 * fails, or -1000 when the client is unknown. */
int nvsniff_control(uint32_t client, uint32_t object, uint32_t cmd, void *params, uint32_t size)
{
	int fd = -1;
	for (int i = 0; i < 64 && clients[i].client; i++)
		if (clients[i].client == client)
			fd = clients[i].fd;
	if (fd < 0)
		return -1000;
	uint8_t nvos54[32] = { 0 };
	U32(nvos54, 0) = client;
	U32(nvos54, 4) = object;
	U32(nvos54, 8) = cmd;
	U64(nvos54, 16) = (uint64_t)(uintptr_t)params;
	U32(nvos54, 24) = size;
	if (ioctl(fd, 0xc020462aUL, nvos54) < 0)
		return -errno;
	return (int)U32(nvos54, 28);
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
	int ret, injected = 0;
	if (k != 'u' && inr == 0x2a && isize == 32 && inner && listed("NVSNIFF_EPERM", U32(inner, 8))) {
		/* what the deny tier would do: the driver never sees the call */
		errno = EPERM;
		ret = -1;
		injected = 1;
	} else if (k != 'u' && inr == 0x2a && isize == 32 && inner && listed("NVSNIFF_RMERR", U32(inner, 8))) {
		/* an RM refusal: NV_ERR_INSUFFICIENT_PERMISSIONS in the status, ioctl success */
		U32(inner, 28) = 0x1b;
		ret = 0;
		injected = 2;
	} else {
		ret = real_ioctl(fd, req, arg);
	}
	int saved = errno;
	if (!ret && !injected && k != 'u' && inr == 0x2a && isize == 32 && inner)
		apply_view(inner);
	char post[1536];
	post[0] = 0;
	if (k != 'u')
		describe_rm(post, sizeof post, inr, isize, inner, 0);
	if (!ret && k == 'c' && inr == 0x2b && (isize == 32 || isize == 48) && inner &&
	    !U32(inner, isize == 32 ? 28 : 40))
		remember(U32(inner, 0), fd);

	pthread_mutex_lock(&lock);
	if (k == 'u')
		fprintf(out, "%d uvm cmd=%lu ret=%d\n", getpid(), req, ret);
	else
		fprintf(out, "%d %s fd=%d nr=%#x size=%u%s ret=%d%s | %s | %s\n", getpid(),
			k == 'c' ? "ctl" : "gpu", fd, inr, isize, inner != arg ? " (xfer)" : "", ret,
			injected == 1 ? " INJECTED-EPERM" : injected == 2 ? " INJECTED-RMERR" : "", pre, post);
	pthread_mutex_unlock(&lock);
	errno = saved;
	return ret;
}
