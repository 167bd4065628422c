/*
 * rcoder-confine: the exec wrapper of rcoder/landlock.py, in C, so that an agent confined from its
 * own process costs a bare exec of a small static binary (~0.3 ms) instead of a Python start-up
 * (~15-30 ms). Built by `make` (`cc -static`); where it is not built, rcoder starts agents through
 * `python -I -S landlock.py` with the same arguments (rcoder.agent.confinement.sandbox.wrapper_command).
 *
 *     rcoder-confine [--parent PID] [--user UID:GID] [--cap NAME]... [--read PATH]... [--write PATH]...
 *                    [--connect PORT]... [--bind PORT]... -- ARGV...
 *
 * It does what rcoder/landlock.py's apply() and main() do, in the same order, and nothing more
 * (docs/confinement.md#what-an-agent-can-reach, "How."; tests/test_landlock.py runs each test of the
 * wrapper against both):
 *   1. a ruleset handling every file-system right the kernel's ABI has (scoped signals and
 *      abstract UNIX sockets from ABI 6); --read paths get execute and read, --write paths every
 *      handled right but making device nodes and device ioctls; a path that does not exist is
 *      skipped; a path that does not name itself
 *      (a link put in its place since rcoder resolved it) is skipped, /proc and /dev entries
 *      excepted (/proc/self is this process's own: the reason to confine here, after the fork);
 *      a rule on a file keeps only the rights a file can carry; from ABI 4 TCP connect and bind
 *      are handled too, allowed only to the --connect and --bind ports;
 *   2. capabilities: the bounding set emptied but for the --cap ones (dac_override,
 *      dac_read_search, fowner: what a confined git of the checkpoints may keep), the ambient set
 *      cleared; --user: no supplementary groups, then the gid and uid (real, effective, saved);
 *      then the permitted and effective sets are the --cap ones still held, the inheritable set
 *      empty. A root process execs with its bounding set as its capabilities, anyone else with
 *      none (docs/confinement.md#security);
 *   3. --parent: PR_SET_PDEATHSIG=SIGKILL, after the switch (which clears it), and an exit if the
 *      daemon is already gone;
 *   4. no_new_privs, landlock_restrict_self, execv(ARGV).
 * A failure is exit 126 (127: ARGV[0] not found) and one line on stderr, never an unconfined agent.
 * The policy (which paths, which rights) is rcoder's, in Python; this file carries it out.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* the kernel's numbers (uapi linux/landlock.h; the same on every architecture), written out so the
 * build needs no kernel headers new enough to have them */
#define SYS_CREATE_RULESET 444
#define SYS_ADD_RULE 445
#define SYS_RESTRICT_SELF 446
#define CREATE_RULESET_VERSION 1u
#define RULE_PATH_BENEATH 1
#define RULE_NET_PORT 2
#define BIND_TCP (1ull << 0)
#define CONNECT_TCP (1ull << 1)
#define EXECUTE (1ull << 0)
#define WRITE_FILE (1ull << 1)
#define READ_FILE (1ull << 2)
#define READ_DIR (1ull << 3)
#define ABI1_FS ((1ull << 13) - 1)
#define REFER (1ull << 13)
#define TRUNCATE (1ull << 14)
#define IOCTL_DEV (1ull << 15)
#define READ (EXECUTE | READ_FILE | READ_DIR)
#define FILE_RIGHTS (EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV)
#define SCOPES 3ull /* abstract UNIX sockets, signals: ABI 6 */
#define MAKE_CHAR (1ull << 6)
#define MAKE_BLOCK (1ull << 11)
#define DEVICES (MAKE_CHAR | MAKE_BLOCK | IOCTL_DEV) /* never granted: no device node, no device ioctl */

#define EXIT_NOT_CONFINED 126
#define EXIT_NOT_FOUND 127
#define USAGE                                                                                              \
    "usage: rcoder-confine [--parent PID] [--user UID:GID] [--cap NAME]... [--read PATH]... [--write PATH]... " \
    "[--connect PORT]... [--bind PORT]... -- ARGV..."

struct ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
};

struct __attribute__((packed)) path_beneath_attr {
    uint64_t allowed_access;
    int32_t parent_fd;
};

struct __attribute__((packed)) net_port_attr {
    uint64_t allowed_access;
    uint64_t port;
};

static void refuse(const char *format, ...) {
    va_list args;
    fputs("rcoder-landlock: the agent was not started, it could not be confined: ", stderr);
    va_start(args, format);
    vfprintf(stderr, format, args);
    va_end(args);
    fputc('\n', stderr);
    exit(EXIT_NOT_CONFINED);
}

static int number(const char *text, long *value) {
    char *end;
    if (!*text || *text == '-' || *text == '+')
        return 0;
    errno = 0;
    *value = strtol(text, &end, 10);
    return !errno && !*end && *value >= 0 && *value <= INT_MAX;
}

/* `path` made absolute (against the working folder) and normalised as Python's
 * os.path.normpath(os.path.abspath(path)) does: no empty, "." or ".." parts, no trailing slash */
static void normalised(const char *path, char *out, size_t size) {
    char joined[PATH_MAX * 2];
    if (path[0] == '/') {
        snprintf(joined, sizeof joined, "%s", path);
    } else {
        char cwd[PATH_MAX];
        if (!getcwd(cwd, sizeof cwd))
            refuse("getcwd: %s", strerror(errno));
        snprintf(joined, sizeof joined, "%s/%s", cwd, path);
    }
    size_t length = 0;
    out[0] = '\0';
    for (char *part = strtok(joined, "/"); part; part = strtok(NULL, "/")) {
        if (!strcmp(part, "."))
            continue;
        if (!strcmp(part, "..")) {
            while (length > 0 && out[length] != '/')
                length--;
            out[length] = '\0';
            continue;
        }
        size_t add = strlen(part);
        if (length + 1 + add + 1 > size)
            refuse("%s: %s", path, strerror(ENAMETOOLONG));
        out[length++] = '/';
        memcpy(out + length, part, add + 1);
        length += add;
    }
    if (length == 0)
        snprintf(out, size, "/");
}

/* whether `fd` was opened at `path` itself, no link followed on the way (landlock.py's _as_named) */
static int as_named(int fd, const char *path) {
    char named[PATH_MAX], link[32], target[PATH_MAX];
    normalised(path, named, sizeof named);
    if (!strncmp(named, "/proc/", 6) || !strncmp(named, "/dev/", 5))
        return 1;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t length = readlink(link, target, sizeof target - 1);
    if (length < 0)
        refuse("readlink %s: %s", link, strerror(errno));
    target[length] = '\0';
    return !strcmp(target, named);
}

static void allow(int ruleset, const char *path, uint64_t rights) {
    int fd = open(path, O_PATH | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return;
        refuse("add_rule %s: %s", path, strerror(errno));
    }
    struct stat info;
    if (as_named(fd, path)) {
        if (fstat(fd, &info) < 0)
            refuse("fstat %s: %s", path, strerror(errno));
        if (!S_ISDIR(info.st_mode))
            rights &= FILE_RIGHTS;
        struct path_beneath_attr rule = {.allowed_access = rights, .parent_fd = fd};
        if (syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH, &rule, 0) < 0)
            refuse("add_rule %s: %s", path, strerror(errno));
    }
    close(fd);
}

/* the capabilities a confined command may keep, by name (landlock.py's CAPABILITIES) */
static uint64_t capability(const char *name) {
    if (!strcmp(name, "dac_override"))
        return 1ull << CAP_DAC_OVERRIDE;
    if (!strcmp(name, "dac_read_search"))
        return 1ull << CAP_DAC_READ_SEARCH;
    if (!strcmp(name, "fowner"))
        return 1ull << CAP_FOWNER;
    refuse("--cap %s: not one of dac_override, dac_read_search, fowner", name);
    return 0;
}

static void get_caps(struct __user_cap_data_struct data[2]) {
    struct __user_cap_header_struct header = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    if (syscall(SYS_capget, &header, data) < 0)
        refuse("capget: %s", strerror(errno));
}

/* every capability out of the bounding set but `keep`, the ambient set cleared. A process without
 * CAP_SETPCAP cannot drop from its bounding set: one that holds no capability has nothing to lose
 * (no_new_privs keeps an exec from granting any), one that holds some is refused. */
static void bound(uint64_t keep) {
    for (int cap = 0; cap < 64; cap++) {
        if (keep & (1ull << cap))
            continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0 || errno == EINVAL) /* EINVAL: past the kernel's last */
            continue;
        struct __user_cap_data_struct data[2];
        get_caps(data);
        if (errno == EPERM && !(data[0].permitted | data[1].permitted))
            break;
        refuse("prctl(PR_CAPBSET_DROP, %d): %s", cap, strerror(errno));
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        refuse("prctl(PR_CAP_AMBIENT_CLEAR_ALL): %s", strerror(errno));
}

/* the permitted and effective sets: `keep` as far as still held; the inheritable set empty */
static void hold(uint64_t keep) {
    struct __user_cap_header_struct header = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct data[2];
    get_caps(data);
    for (int i = 0; i < 2; i++) {
        data[i].permitted &= (uint32_t)(keep >> (32 * i));
        data[i].effective = data[i].permitted;
        data[i].inheritable = 0;
    }
    if (syscall(SYS_capset, &header, data) < 0)
        refuse("capset: %s", strerror(errno));
}

int main(int argc, char **argv) {
    long parent = 0, uid = -1, gid = -1;
    uint64_t keep = 0;
    const char **read = calloc((size_t)argc, sizeof *read), **write = calloc((size_t)argc, sizeof *write);
    long *connect = calloc((size_t)argc, sizeof *connect), *bind = calloc((size_t)argc, sizeof *bind);
    int reads = 0, writes = 0, connects = 0, binds = 0, command = 0;
    if (!read || !write || !connect || !bind)
        refuse("%s", strerror(ENOMEM));
    for (int i = 1; i < argc; i += 2) {
        if (!strcmp(argv[i], "--")) {
            command = i + 1;
            break;
        }
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (!value)
            refuse("%s", USAGE);
        if (!strcmp(argv[i], "--parent")) {
            if (!number(value, &parent))
                refuse("--parent %s: not a process id", value);
        } else if (!strcmp(argv[i], "--user")) {
            char uid_text[16], *colon = strchr(value, ':');
            size_t length = colon ? (size_t)(colon - value) : 0;
            if (!colon || length >= sizeof uid_text)
                refuse("%s", USAGE);
            memcpy(uid_text, value, length);
            uid_text[length] = '\0';
            if (!number(uid_text, &uid) || !number(colon + 1, &gid))
                refuse("%s", USAGE);
        } else if (!strcmp(argv[i], "--cap")) {
            keep |= capability(value);
        } else if (!strcmp(argv[i], "--read")) {
            read[reads++] = value;
        } else if (!strcmp(argv[i], "--write")) {
            write[writes++] = value;
        } else if (!strcmp(argv[i], "--connect") || !strcmp(argv[i], "--bind")) {
            long port;
            if (!number(value, &port) || port > 65535)
                refuse("%s %s: not a TCP port", argv[i], value);
            if (argv[i][2] == 'c')
                connect[connects++] = port;
            else
                bind[binds++] = port;
        } else {
            refuse("%s", USAGE);
        }
    }
    if (!command || command >= argc)
        refuse("%s", USAGE);

    /* 1. the ruleset, its rules bound as the daemon's uid (the agent's may not open them at all) */
    long abi = syscall(SYS_CREATE_RULESET, NULL, 0, CREATE_RULESET_VERSION);
    if (abi < 1)
        refuse("this kernel offers no Landlock");
    uint64_t handled = ABI1_FS | (abi >= 2 ? REFER : 0) | (abi >= 3 ? TRUNCATE : 0) | (abi >= 5 ? IOCTL_DEV : 0);
    /* from ABI 4 TCP too: a connect or bind to a port without a rule is refused (EACCES) */
    uint64_t handled_net = abi >= 4 ? BIND_TCP | CONNECT_TCP : 0;
    struct ruleset_attr attr = {
        .handled_access_fs = handled, .handled_access_net = handled_net, .scoped = abi >= 6 ? SCOPES : 0};
    size_t size = abi >= 6 ? sizeof attr : 2 * sizeof(uint64_t);
    int ruleset = (int)syscall(SYS_CREATE_RULESET, &attr, size, 0);
    if (ruleset < 0)
        refuse("landlock_create_ruleset: %s", strerror(errno));
    for (int i = 0; i < reads; i++)
        allow(ruleset, read[i], READ & handled);
    for (int i = 0; i < writes; i++)
        allow(ruleset, write[i], handled & ~DEVICES);
    for (int i = 0; handled_net && i < connects + binds; i++) {
        struct net_port_attr rule = {.allowed_access = i < connects ? CONNECT_TCP : BIND_TCP,
                                     .port = (uint64_t)(i < connects ? connect[i] : bind[i - connects])};
        if (syscall(SYS_ADD_RULE, ruleset, RULE_NET_PORT, &rule, 0) < 0)
            refuse("add_rule port %llu: %s", (unsigned long long)rule.port, strerror(errno));
    }

    /* 2. no capability but the kept ones, then the agent's uid and gid */
    bound(keep);
    if (uid >= 0) {
        if (setgroups(0, NULL) < 0 || setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) < 0 ||
            setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0)
            refuse("switching to %ld:%ld: %s", uid, gid, strerror(errno));
    }
    hold(keep);
    /* 3. the death signal */
    if (parent) {
        if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
            refuse("prctl(PR_SET_PDEATHSIG): %s", strerror(errno));
        if (getppid() != (pid_t)parent)
            refuse("the daemon that started this agent is gone");
    }
    /* 4. confined for good, then the agent */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        refuse("prctl(PR_SET_NO_NEW_PRIVS): %s", strerror(errno));
    if (syscall(SYS_RESTRICT_SELF, ruleset, 0) < 0)
        refuse("landlock_restrict_self: %s", strerror(errno));
    close(ruleset);
    execv(argv[command], argv + command);
    fprintf(stderr, "rcoder-landlock: cannot run %s: %s\n", argv[command], strerror(errno));
    return errno == ENOENT ? EXIT_NOT_FOUND : EXIT_NOT_CONFINED;
}
