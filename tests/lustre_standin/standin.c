/* A stand-in for liblustreapi, for tests on machines without Lustre.
 *
 * It exports the functions ckptstore binds, with the signatures of lustre/lustreapi.h,
 * creates files with open(2), and appends one line per call to the file named by
 * $LUSTREAPI_STANDIN_LOG. $LUSTREAPI_STANDIN_FAIL=<function>:<errno> makes that function
 * fail (llapi_file_create returns -errno; the others return -1 and set errno).
 * Built with -DLEGACY_ONLY it exports only llapi_file_create, as old releases did.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void record(const char *format, ...) __attribute__((format(printf, 1, 2)));

#include <stdarg.h>
static void record(const char *format, ...) {
    const char *path = getenv("LUSTREAPI_STANDIN_LOG");
    if (!path) return;
    FILE *log = fopen(path, "a");
    if (!log) return;
    va_list args;
    va_start(args, format);
    vfprintf(log, format, args);
    va_end(args);
    fputc('\n', log);
    fclose(log);
}

static int failing(const char *function) {
    const char *spec = getenv("LUSTREAPI_STANDIN_FAIL");
    size_t length = strlen(function);
    if (spec && strncmp(spec, function, length) == 0 && spec[length] == ':')
        return atoi(spec + length + 1);
    return 0;
}

#ifndef LEGACY_ONLY
struct llapi_layout {
    uint64_t stripe_count;
    uint64_t stripe_size;
    char pool[64];
};

struct llapi_layout *llapi_layout_alloc(void) {
    struct llapi_layout *layout = calloc(1, sizeof *layout);
    record("llapi_layout_alloc");
    return layout;
}

void llapi_layout_free(struct llapi_layout *layout) {
    record("llapi_layout_free");
    free(layout);
}

int llapi_layout_stripe_count_set(struct llapi_layout *layout, uint64_t stripe_count) {
    int err = failing("llapi_layout_stripe_count_set");
    record("llapi_layout_stripe_count_set %llu", (unsigned long long)stripe_count);
    if (err) { errno = err; return -1; }
    layout->stripe_count = stripe_count;
    return 0;
}

int llapi_layout_stripe_size_set(struct llapi_layout *layout, uint64_t stripe_size) {
    int err = failing("llapi_layout_stripe_size_set");
    record("llapi_layout_stripe_size_set %llu", (unsigned long long)stripe_size);
    if (err) { errno = err; return -1; }
    layout->stripe_size = stripe_size;
    return 0;
}

int llapi_layout_pool_name_set(struct llapi_layout *layout, const char *pool_name) {
    record("llapi_layout_pool_name_set %s", pool_name);
    strncpy(layout->pool, pool_name, sizeof layout->pool - 1);
    return 0;
}

int llapi_layout_file_create(const char *path, int open_flags, int mode,
                             const struct llapi_layout *layout) {
    int err = failing("llapi_layout_file_create");
    record("llapi_layout_file_create %s %d %o %llu %llu", path, open_flags, mode,
           (unsigned long long)layout->stripe_count, (unsigned long long)layout->stripe_size);
    if (err) { errno = err; return -1; }
    return open(path, open_flags | O_CREAT, mode);
}
#endif

int llapi_file_create(const char *name, unsigned long long stripe_size, int stripe_offset,
                      int stripe_count, int stripe_pattern) {
    int err = failing("llapi_file_create");
    record("llapi_file_create %s %llu %d %d %d", name, stripe_size, stripe_offset,
           stripe_count, stripe_pattern);
    if (err) return -err;
    int fd = open(name, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0) return -errno;
    close(fd);
    return 0;
}
