/*
 * write-user-probe: asks the running kernel's verifier whether a tracepoint program may call
 * bpf_probe_write_user (what gpud's in-container memory view needs). It loads a six-instruction
 * program that calls the helper, prints "allowed" or "refused" with the verifier's reason, and
 * attaches nothing. A measurement tool for the real-GPU checks, not part of gpud.
 *
 * Build: gcc -O2 -Wall -o write-user-probe write-user-probe.c
 */
#include <linux/bpf.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define INSN(c, d, s, o, i) ((struct bpf_insn){ .code = (c), .dst_reg = (d), .src_reg = (s), .off = (o), .imm = (i) })

int main(void)
{
	struct bpf_insn prog[] = {
		INSN(BPF_ALU64 | BPF_MOV | BPF_K, 1, 0, 0, 0),	    /* r1 = 0 (destination)   */
		INSN(BPF_ST | BPF_MEM | BPF_DW, 10, 0, -8, 0),	    /* *(u64 *)(r10 - 8) = 0  */
		INSN(BPF_ALU64 | BPF_MOV | BPF_X, 2, 10, 0, 0),	    /* r2 = r10               */
		INSN(BPF_ALU64 | BPF_ADD | BPF_K, 2, 0, 0, -8),	    /* r2 -= 8 (source)       */
		INSN(BPF_ALU64 | BPF_MOV | BPF_K, 3, 0, 0, 8),	    /* r3 = 8 (length)        */
		INSN(BPF_JMP | BPF_CALL, 0, 0, 0, BPF_FUNC_probe_write_user),
		INSN(BPF_ALU64 | BPF_MOV | BPF_K, 0, 0, 0, 0),
		INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),
	};
	static char log[65536];
	union bpf_attr a;
	memset(&a, 0, sizeof a);
	a.prog_type = BPF_PROG_TYPE_TRACEPOINT;
	a.insns = (uint64_t)(uintptr_t)prog;
	a.insn_cnt = sizeof prog / sizeof prog[0];
	a.license = (uint64_t)(uintptr_t) "GPL";
	a.log_buf = (uint64_t)(uintptr_t)log;
	a.log_size = sizeof log;
	a.log_level = 1;
	long fd = syscall(SYS_bpf, BPF_PROG_LOAD, &a, sizeof a);
	if (fd >= 0) {
		printf("bpf_probe_write_user: allowed\n");
		return 0;
	}
	perror("bpf_probe_write_user: refused");
	printf("%s\n", log);
	return 1;
}
