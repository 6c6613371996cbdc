/* Swaps a regular file and a FIFO at DIR/target for ever, as an attacker
 * in a sandbox would to make a download open the FIFO (which blocks a
 * plain open until a writer comes).
 *
 * Usage: swap DIR. Makes DIR/target (a regular file holding "file\n") and
 * DIR/other (a FIFO), then exchanges them with renameat2(RENAME_EXCHANGE)
 * as fast as it can. Where the kernel refuses the exchange (gVisor's may),
 * it alternates instead: a fresh regular file, then a fresh FIFO, each
 * renamed over DIR/target. Either way DIR/target always exists, a regular
 * file or a FIFO. Prints the way it swaps, then nothing. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

static void make_file(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || write(fd, "file\n", 5) != 5 || close(fd) != 0) {
        perror(path);
        exit(1);
    }
}

static void make_fifo(const char *path) {
    if (mkfifo(path, 0644) != 0 && errno != EEXIST) {
        perror(path);
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: swap DIR\n");
        return 2;
    }
    if (chdir(argv[1]) != 0) {
        perror(argv[1]);
        return 1;
    }
    make_fifo("other");
    make_file("target");
    if (syscall(SYS_renameat2, AT_FDCWD, "target", AT_FDCWD, "other", RENAME_EXCHANGE) == 0) {
        printf("exchange\n");
        fflush(stdout);
        for (;;)
            syscall(SYS_renameat2, AT_FDCWD, "target", AT_FDCWD, "other", RENAME_EXCHANGE);
    }
    printf("rename (renameat2: %s)\n", strerror(errno));
    fflush(stdout);
    for (;;) {
        make_file("next-file");
        rename("next-file", "target");
        make_fifo("next-fifo");
        rename("next-fifo", "target");
    }
}
