/* Tries system calls a sandbox must refuse and some it must allow, and
 * prints one line per call: `<name> ok`, `<name> errno <n>`, or, for calls
 * made in a child, `<name> signal <n>` when the child was killed.
 * Built static (cc -static), so it runs on any root. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/netlink.h>
#include <linux/perf_event.h>

#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif
#define X32_SYSCALL_BIT 0x40000000L
#define KCMP_VM 1
#define KEYCTL_GET_KEYRING_ID 0
#define KEY_SPEC_SESSION_KEYRING -3

static void report(const char *name, long rc) {
    if (rc < 0)
        printf("%s errno %d\n", name, errno);
    else
        printf("%s ok\n", name);
    fflush(stdout);
}

static void close_if(long fd) {
    if (fd >= 0)
        close((int)fd);
}

/* Reports how a child that ran one call ended: exit 0 is success. */
static void report_child(const char *name, pid_t pid) {
    int status;
    if (pid < 0) {
        report(name, -1);
        return;
    }
    if (waitpid(pid, &status, 0) < 0) {
        report(name, -1);
    } else if (WIFSIGNALED(status)) {
        printf("%s signal %d\n", name, WTERMSIG(status));
    } else if (WEXITSTATUS(status) == 0) {
        printf("%s ok\n", name);
    } else {
        printf("%s errno %d\n", name, WEXITSTATUS(status));
    }
    fflush(stdout);
}

static void *thread_main(void *arg) { return arg; }

int main(void) {
    char byte = 0;
    struct iovec local = {&byte, 1}, remote = {&byte, 1};

    /* Reaching into PID 1, which holds the socket the host talks to. */
    long init_pidfd = syscall(SYS_pidfd_open, 1, 0);
    report("pidfd_getfd", syscall(SYS_pidfd_getfd, init_pidfd, 0, 0));
    close_if(init_pidfd);
    report("ptrace", ptrace(PTRACE_SEIZE, 1, 0, 0));
    report("process_vm_readv", process_vm_readv(1, &local, 1, &remote, 1, 0));
    report("process_vm_writev", process_vm_writev(1, &local, 1, &remote, 1, 0));
    report("kcmp", syscall(SYS_kcmp, getpid(), getpid(), KCMP_VM, 0, 0));

    /* Families and personalities outside the allowed ones. */
    long fd = socket(AF_VSOCK, SOCK_STREAM, 0);
    report("socket_vsock", fd);
    close_if(fd);
    fd = socket(AF_PACKET, SOCK_RAW, 0);
    report("socket_packet", fd);
    close_if(fd);
    fd = socket(AF_NETLINK, SOCK_RAW, NETLINK_GENERIC);
    report("socket_netlink_generic", fd);
    close_if(fd);
    report("personality_read_implies_exec", syscall(SYS_personality, READ_IMPLIES_EXEC));
    report("ioctl_tiocsti", ioctl(0, TIOCSTI, "x"));

    /* Namespaces, mounts, and kernel interfaces ordinary programs do
     * without. */
    report("unshare_user", syscall(SYS_unshare, CLONE_NEWUSER));
    long child = syscall(SYS_clone, CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0);
    if (child == 0)
        _exit(0);
    if (child < 0)
        report("clone_newns", child);
    else
        report_child("clone_newns", (pid_t)child);
    report("mount", mount("none", "/tmp", "tmpfs", 0, NULL));
    struct {
        unsigned int bytes;
        int type;
        unsigned char handle[8];
    } handle = {8, 1, {0}};
    int root = open("/", O_RDONLY | O_DIRECTORY);
    report("open_by_handle_at", syscall(SYS_open_by_handle_at, root, &handle, O_RDONLY));
    close_if(root);
    unsigned char params[120] = {0};
    fd = syscall(SYS_io_uring_setup, 1, params);
    report("io_uring_setup", fd);
    close_if(fd);
    report("keyctl", syscall(SYS_keyctl, KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0));
    unsigned char bpf_attr[128] = {0};
    fd = syscall(SYS_bpf, 0, bpf_attr, sizeof bpf_attr);
    report("bpf", fd);
    close_if(fd);
    struct perf_event_attr perf;
    memset(&perf, 0, sizeof perf);
    perf.type = PERF_TYPE_SOFTWARE;
    perf.size = sizeof perf;
    perf.config = PERF_COUNT_SW_TASK_CLOCK;
    perf.exclude_kernel = 1;
    fd = syscall(SYS_perf_event_open, &perf, 0, -1, -1, 0);
    report("perf_event_open", fd);
    close_if(fd);

    /* Numbers of other ABIs: x32 (bit 30), and i386 through int 0x80 in a
     * child, which the filter kills. */
    report("x32_getpid", syscall(SYS_getpid | X32_SYSCALL_BIT));
    pid_t i386 = fork();
    if (i386 == 0) {
        long ret = 20; /* i386 getpid */
        __asm__ volatile("int $0x80" : "+a"(ret) : : "memory");
        _exit(ret > 0 ? 0 : 1);
    }
    report_child("i386_getpid", i386);

    /* clone3 answers ENOSYS so libc falls back to clone. */
    uint64_t clone3_args[11] = {0};
    clone3_args[4] = SIGCHLD; /* exit_signal */
    child = syscall(SYS_clone3, clone3_args, sizeof clone3_args);
    if (child == 0)
        _exit(0);
    if (child < 0)
        report("clone3", child);
    else
        report_child("clone3", (pid_t)child);

    /* Calls a normal program makes, which must work. */
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    report("socket_unix", fd);
    close_if(fd);
    fd = socket(AF_INET, SOCK_DGRAM, 0);
    report("socket_inet", fd);
    close_if(fd);
    fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
    report("socket_netlink_route", fd);
    close_if(fd);
    int pair[2];
    long ok = socketpair(AF_UNIX, SOCK_STREAM, 0, pair);
    report("socketpair_unix", ok);
    if (ok == 0) {
        int pending = 0;
        report("ioctl_fionread", ioctl(pair[0], FIONREAD, &pending));
        close(pair[0]);
        close(pair[1]);
    }
    report("personality_query", syscall(SYS_personality, 0xffffffffUL));
    fd = syscall(SYS_pidfd_open, getpid(), 0);
    report("pidfd_open_self", fd);
    close_if(fd);
    pid_t forked = fork();
    if (forked == 0)
        _exit(0);
    report_child("fork", forked);
    pthread_t thread;
    int err = pthread_create(&thread, NULL, thread_main, NULL);
    if (err == 0)
        pthread_join(thread, NULL);
    errno = err;
    report("thread", err ? -1 : 0);
    return 0;
}
