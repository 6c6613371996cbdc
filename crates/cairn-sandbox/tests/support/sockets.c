/* Creates IP sockets of the protocols a sandbox refuses (MPTCP, UDP-Lite,
 * SCTP, raw) and of those it keeps (TCP, UDP, ICMP echo datagrams), with
 * and without SOCK_NONBLOCK|SOCK_CLOEXEC, and sends a byte over loopback
 * TCP and UDP. Prints one line per attempt: `<name> ok` or
 * `<name> errno <n>`. Built static (cc -static), so it runs on any root. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#ifndef IPPROTO_MPTCP
#define IPPROTO_MPTCP 262
#endif
#ifndef IPPROTO_UDPLITE
#define IPPROTO_UDPLITE 136
#endif
#ifndef IPPROTO_SCTP
#define IPPROTO_SCTP 132
#endif

#define FLAGS (SOCK_NONBLOCK | SOCK_CLOEXEC)

static void report(const char *name, int rc) {
    if (rc < 0)
        printf("%s errno %d\n", name, errno);
    else
        printf("%s ok\n", name);
    fflush(stdout);
}

static void try_socket(const char *name, int family, int type, int protocol) {
    int fd = socket(family, type, protocol);
    report(name, fd);
    if (fd >= 0)
        close(fd);
}

/* One byte from a client to a server bound on 127.0.0.1, of `type`. */
static int loopback(int type) {
    struct sockaddr_in addr = {.sin_family = AF_INET};
    socklen_t len = sizeof addr;
    int server = -1, client = -1, peer = -1, rc = -1;
    char byte = 'x', got = 0;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if ((server = socket(AF_INET, type | SOCK_CLOEXEC, 0)) < 0)
        goto out;
    if (bind(server, (struct sockaddr *)&addr, sizeof addr) < 0 ||
        getsockname(server, (struct sockaddr *)&addr, &len) < 0)
        goto out;
    if (type == SOCK_STREAM && listen(server, 1) < 0)
        goto out;
    if ((client = socket(AF_INET, type | SOCK_CLOEXEC, 0)) < 0)
        goto out;
    if (connect(client, (struct sockaddr *)&addr, sizeof addr) < 0 || send(client, &byte, 1, 0) != 1)
        goto out;
    peer = type == SOCK_STREAM ? accept(server, NULL, NULL) : server;
    if (peer < 0 || recv(peer, &got, 1, 0) != 1)
        goto out;
    if (got != byte) {
        errno = EPROTO;
        goto out;
    }
    rc = 0;
out:;
    int saved = errno;
    if (peer >= 0 && peer != server)
        close(peer);
    if (client >= 0)
        close(client);
    if (server >= 0)
        close(server);
    errno = saved;
    return rc;
}

int main(void) {
    /* Refused by the native filter. */
    try_socket("mptcp4", AF_INET, SOCK_STREAM, IPPROTO_MPTCP);
    try_socket("mptcp4_flags", AF_INET, SOCK_STREAM | FLAGS, IPPROTO_MPTCP);
    try_socket("mptcp6", AF_INET6, SOCK_STREAM, IPPROTO_MPTCP);
    try_socket("udplite4", AF_INET, SOCK_DGRAM, IPPROTO_UDPLITE);
    try_socket("udplite6", AF_INET6, SOCK_DGRAM, IPPROTO_UDPLITE);
    try_socket("udplite6_flags", AF_INET6, SOCK_DGRAM | FLAGS, IPPROTO_UDPLITE);
    try_socket("sctp4", AF_INET, SOCK_STREAM, IPPROTO_SCTP);
    try_socket("sctp4_seqpacket", AF_INET, SOCK_SEQPACKET, IPPROTO_SCTP);
    try_socket("raw4_icmp", AF_INET, SOCK_RAW, IPPROTO_ICMP);
    try_socket("raw4_raw", AF_INET, SOCK_RAW | FLAGS, IPPROTO_RAW);
    try_socket("raw6_icmp", AF_INET6, SOCK_RAW, IPPROTO_ICMPV6);

    /* Kept. */
    try_socket("tcp4", AF_INET, SOCK_STREAM, 0);
    try_socket("tcp4_flags", AF_INET, SOCK_STREAM | FLAGS, IPPROTO_TCP);
    try_socket("tcp6", AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP);
    try_socket("udp4", AF_INET, SOCK_DGRAM, 0);
    try_socket("udp4_flags", AF_INET, SOCK_DGRAM | FLAGS, IPPROTO_UDP);
    try_socket("udp6", AF_INET6, SOCK_DGRAM | SOCK_NONBLOCK, 0);
    try_socket("ping4", AF_INET, SOCK_DGRAM, IPPROTO_ICMP);
    try_socket("ping6", AF_INET6, SOCK_DGRAM | FLAGS, IPPROTO_ICMPV6);
    try_socket("unix_seqpacket", AF_UNIX, SOCK_SEQPACKET, 0);
    int pair[2];
    int rc = socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, pair);
    report("socketpair_unix", rc);
    if (rc == 0) {
        close(pair[0]);
        close(pair[1]);
    }
    report("tcp4_loopback", loopback(SOCK_STREAM));
    report("udp4_loopback", loopback(SOCK_DGRAM));
    return 0;
}
