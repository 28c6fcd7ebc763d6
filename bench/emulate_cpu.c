// A smaller x86 CPU for one process tree (bench/emulate.py builds this and preloads it: LD_PRELOAD).
//
// Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID, on CPUs whose /proc/cpuinfo has cpuid_fault) turns every
// CPUID instruction of a thread into a SIGSEGV; the handler here runs the real one with faulting briefly off,
// clears the feature bits of the instructions the emulated CPU lacks and steps over it. Every library that asks
// CPUID what it may use (onnxruntime's MLAS, torch, numpy, OpenBLAS, libgcc's __builtin_cpu_supports, so
// model/kernels) then picks the kernels of the smaller CPU; /proc/cpuinfo is read with the same flags removed.
// The setting is inherited by threads and forks; an exec'd program loads this again (LD_PRELOAD stays set). Where
// CPUID cannot fault (bench/emulate.py refuses to start there; a program QEMU runs, inheriting LD_PRELOAD, is on
// QEMU's own emulated CPU) only /proc/cpuinfo is filtered.
//
// ADDNORM_EMULATE names what to hide: "avx2" (AVX-512, AVX-VNNI and AMX: an AVX2 and FMA CPU) or "avx512" (AMX:
// an AVX-512 VNNI CPU without it). Handlers others install for SIGSEGV (Python's faulthandler, pytest) are kept
// and called for every SIGSEGV that is not a faulted CPUID.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define ARCH_SET_CPUID 0x1012
#define BIT(n) (1u << (n))

static int hide_avx512;                 // else only AMX
static struct sigaction theirs;         // the SIGSEGV handler the program asked for

static void* next(const char* name) { return dlsym(RTLD_NEXT, name); }
static int real_sigaction(int sig, const struct sigaction* act, struct sigaction* old) {
  static int (*real)(int, const struct sigaction*, struct sigaction*);
  if (!real) real = (int (*)(int, const struct sigaction*, struct sigaction*))next("sigaction");
  return real(sig, act, old);
}

static void cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
  __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

static void masked(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
  const uint32_t amx_edx = BIT(22) | BIT(24) | BIT(25);           // AMX-BF16, AMX-TILE, AMX-INT8
  if (leaf == 7 && sub == 0) {
    r[3] &= ~amx_edx;
    if (hide_avx512) {
      r[1] &= ~(BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31));  // F DQ IFMA PF ER CD BW VL
      r[2] &= ~(BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14));  // VBMI VBMI2 VNNI BITALG VPOPCNTDQ
      r[3] &= ~(BIT(2) | BIT(3) | BIT(8) | BIT(23));             // 4VNNIW 4FMAPS VP2INTERSECT FP16
    }
  } else if (leaf == 7 && sub == 1) {
    r[0] &= ~(BIT(21) | BIT(22));                                // AMX-FP16, AMX-COMPLEX is EDX 8: below
    r[3] &= ~BIT(8);
    if (hide_avx512) r[0] &= ~(BIT(4) | BIT(5) | BIT(23));       // AVX-VNNI, AVX512-BF16, AVX-IFMA
    if (hide_avx512) r[3] &= ~(BIT(4) | BIT(5));                 // AVX-VNNI-INT8, AVX-NE-CONVERT
  } else if (leaf == 0xd && sub == 0) {                          // the XSAVE state components offered
    r[0] &= ~(BIT(17) | BIT(18));                                // tile config and data
    if (hide_avx512) r[0] &= ~(BIT(5) | BIT(6) | BIT(7));        // opmask and ZMM
  }
}

static void on_segv(int sig, siginfo_t* info, void* context) {
  greg_t* regs = ((ucontext_t*)context)->uc_mcontext.gregs;
  const unsigned char* ip = (const unsigned char*)regs[REG_RIP];
  // A faulted CPUID is a SIGSEGV the kernel sends (SI_KERNEL) at the instruction 0f a2.
  if (info->si_code == SI_KERNEL && ip[0] == 0x0f && ip[1] == 0xa2) {
    uint32_t r[4], leaf = (uint32_t)regs[REG_RAX], sub = (uint32_t)regs[REG_RCX];
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
    cpuid(leaf, sub, r);
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
    masked(leaf, sub, r);
    regs[REG_RAX] = r[0], regs[REG_RBX] = r[1], regs[REG_RCX] = r[2], regs[REG_RDX] = r[3];
    regs[REG_RIP] += 2;
    return;
  }
  if (theirs.sa_flags & SA_SIGINFO) {
    theirs.sa_sigaction(sig, info, context);
  } else if (theirs.sa_handler != SIG_DFL && theirs.sa_handler != SIG_IGN) {
    theirs.sa_handler(sig);
  } else {  // what the default would have done: die of it
    struct sigaction dfl = {0};
    dfl.sa_handler = SIG_DFL;
    real_sigaction(SIGSEGV, &dfl, NULL);
    raise(SIGSEGV);
  }
}

// The program's SIGSEGV handler is kept here, behind ours.
int sigaction(int sig, const struct sigaction* act, struct sigaction* old) {
  if (sig != SIGSEGV) return real_sigaction(sig, act, old);
  if (old) *old = theirs;
  if (act) theirs = *act;
  return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
  struct sigaction act = {0}, old;
  act.sa_handler = handler;
  sigemptyset(&act.sa_mask);
  act.sa_flags = SA_RESTART;
  return sigaction(sig, &act, &old) == 0 ? old.sa_handler : SIG_ERR;
}

// /proc/cpuinfo without the hidden flags, as an unlinked in-memory file.
static int hidden(const char* word, size_t n) {
  if (n >= 4 && strncmp(word, "amx_", 4) == 0) return 1;
  if (!hide_avx512) return 0;
  return (n >= 6 && strncmp(word, "avx512", 6) == 0) || (n >= 8 && strncmp(word, "avx_vnni", 8) == 0) ||
         (n == 8 && strncmp(word, "avx_ifma", 8) == 0) || (n == 14 && strncmp(word, "avx_ne_convert", 14) == 0);
}

static int cpuinfo(int flags) {
  const int in = (int)syscall(SYS_openat, AT_FDCWD, "/proc/cpuinfo", O_RDONLY | O_CLOEXEC);
  const int out = (int)syscall(SYS_memfd_create, "cpuinfo", (flags & O_CLOEXEC) ? MFD_CLOEXEC : 0);
  if (in < 0 || out < 0) return in < 0 ? in : out;
  char buffer[4096], line[8192];  // a flags line is under 2000
  size_t used = 0;
  ssize_t got;
  while ((got = read(in, buffer, sizeof buffer)) > 0) {
    for (ssize_t i = 0; i < got; ++i) {
      if (used < sizeof line - 1) line[used++] = buffer[i];
      if (buffer[i] != '\n') continue;
      line[used] = 0;
      const int is_flags = strncmp(line, "flags", 5) == 0;
      for (size_t at = 0; at < used;) {  // words separated by spaces; hidden ones (of a flags line) dropped
        size_t end = at;
        while (end < used && line[end] != ' ' && line[end] != '\n') ++end;
        if (!(is_flags && hidden(line + at, end - at))) {
          if (write(out, line + at, end - at) < 0) break;
          if (end < used && write(out, line + end, 1) < 0) break;
        }
        at = end + 1;
      }
      used = 0;
    }
  }
  close(in);
  lseek(out, 0, SEEK_SET);
  return out;
}


#define OPEN(name, ...)                                             \
  int name(const char* path, int flags, ...) {                     \
    va_list ap;                                                     \
    va_start(ap, flags);                                            \
    const mode_t mode = va_arg(ap, mode_t);                         \
    va_end(ap);                                                     \
    if (strcmp(path, "/proc/cpuinfo") == 0) return cpuinfo(flags); \
    static int (*real)(const char*, int, ...);                      \
    if (!real) real = (int (*)(const char*, int, ...))next(#name);  \
    return real(path, flags, mode);                                 \
  }
OPEN(open)
OPEN(open64)

#define OPENAT(name)                                                \
  int name(int dir, const char* path, int flags, ...) {            \
    va_list ap;                                                     \
    va_start(ap, flags);                                            \
    const mode_t mode = va_arg(ap, mode_t);                         \
    va_end(ap);                                                     \
    if (strcmp(path, "/proc/cpuinfo") == 0) return cpuinfo(flags); \
    static int (*real)(int, const char*, int, ...);                 \
    if (!real) real = (int (*)(int, const char*, int, ...))next(#name); \
    return real(dir, path, flags, mode);                            \
  }
OPENAT(openat)
OPENAT(openat64)

#define FOPEN(name)                                                            \
  FILE* name(const char* path, const char* mode) {                            \
    static FILE* (*real)(const char*, const char*);                           \
    if (!real) real = (FILE * (*)(const char*, const char*)) next(#name);     \
    if (strcmp(path, "/proc/cpuinfo") != 0) return real(path, mode);          \
    const int fd = cpuinfo(O_CLOEXEC);                                        \
    return fd < 0 ? NULL : fdopen(fd, "r");                                   \
  }
FOPEN(fopen)
FOPEN(fopen64)

__attribute__((constructor)) static void start(void) {
  const char* what = getenv("ADDNORM_EMULATE");
  hide_avx512 = !what || strcmp(what, "avx512") != 0;
  struct sigaction ours = {0};
  ours.sa_sigaction = on_segv;
  ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&ours.sa_mask);
  real_sigaction(SIGSEGV, &ours, &theirs);
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
}
