/* Shared by the shipped modules: read all of stdin, write all of a buffer. WASI preview 1, no files. */
#ifndef COTSERVE_MODULE_COMMON_H
#define COTSERVE_MODULE_COMMON_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char *read_all(size_t *len) {
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) exit(70);
    for (;;) {
        ssize_t got = read(0, buf + n, cap - n);
        if (got < 0) exit(74);
        if (got == 0) break;
        n += (size_t)got;
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
            if (!buf) exit(70);
        }
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

static void write_all(const char *p, size_t n) {
    while (n > 0) {
        ssize_t put = write(1, p, n);
        if (put <= 0) exit(74);
        p += put;
        n -= (size_t)put;
    }
}
#endif
