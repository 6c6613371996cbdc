/* Sets (argv[1] = "set") or reads ("get") the file capability
 * cap_net_bind_service+ep of argv[2], as setcap and getcap would, and prints
 * what the kernel shows: "rev <revision> permitted <hex>" or the error. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <stdint.h>
#include <sys/xattr.h>

int main(int argc, char **argv) {
    if (argc < 3)
        return 2;
    uint32_t cap[5] = {0x02000000u | 1u /* revision 2, effective */, 1u << 10 /* NET_BIND_SERVICE */, 0, 0, 0};
    if (strcmp(argv[1], "set") == 0) {
        if (setxattr(argv[2], "security.capability", cap, sizeof cap, 0) != 0) {
            printf("set %s\n", strerror(errno));
            return 1;
        }
        return 0;
    }
    uint32_t got[6] = {0};
    ssize_t n = getxattr(argv[2], "security.capability", got, sizeof got);
    if (n < 0) {
        printf("get %s\n", strerror(errno));
        return 1;
    }
    printf("rev %u permitted %x\n", got[0] >> 24, got[1]);
    return 0;
}
