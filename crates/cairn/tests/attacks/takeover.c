/* An attacker inside a native sandbox: takes PID 1's listening socket
 * (cairn-init serves the host on fd 3) every way a process could, and
 * answers the host in init's place with the frames in the file argv[1]
 * (a forged "exit 0" with forged output), until it is killed.
 *
 * Prints one line per attempt: "<what> ok" or "<what> <errno name>". */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

static void report(const char *what, long rc) {
    if (rc < 0)
        printf("%s %s\n", what, strerrorname_np(errno));
    else
        printf("%s ok\n", what);
    fflush(stdout);
}

int main(int argc, char **argv) {
    static char forged[65536];
    ssize_t forged_len = 0;
    if (argc > 1) {
        int f = open(argv[1], O_RDONLY);
        if (f >= 0) {
            forged_len = read(f, forged, sizeof forged);
            close(f);
        }
    }
    int sock = -1;
    long pidfd = syscall(SYS_pidfd_open, 1, 0);
    report("pidfd_open", pidfd);
    if (pidfd >= 0) {
        long fd = syscall(SYS_pidfd_getfd, (int)pidfd, 3, 0);
        report("pidfd_getfd", fd);
        if (fd >= 0)
            sock = (int)fd;
    }
    long fd = open("/proc/1/fd/3", O_RDWR);
    report("open_proc_fd", fd);
    if (sock < 0 && fd >= 0)
        sock = (int)fd;
    report("ptrace_seize", ptrace(PTRACE_SEIZE, 1, 0, 0));
    char buf[16];
    struct iovec local = {buf, sizeof buf}, remote = {(void *)0x400000, sizeof buf};
    report("process_vm_readv", syscall(SYS_process_vm_readv, 1, &local, 1, &remote, 1, 0));
    report("kcmp", syscall(SYS_kcmp, getpid(), 1, 0 /* KCMP_FILE */, 0, 3));
    report("open_proc_mem", open("/proc/1/mem", O_RDONLY));
    report("open_proc_environ", open("/proc/1/environ", O_RDONLY));
    if (sock < 0) {
        printf("no socket\n");
        fflush(stdout);
        return 1;
    }
    printf("took the socket\n");
    fflush(stdout);
    for (;;) {
        int c = accept(sock, NULL, NULL);
        if (c < 0)
            continue;
        read(c, buf, sizeof buf);
        write(c, forged, forged_len);
        close(c);
    }
}
