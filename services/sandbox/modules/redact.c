/* redact: replace runs of 9 or more digits, and e-mail addresses, with [redacted]. */
#include <ctype.h>
#include "common.h"

static int is_local(char c) { return isalnum((unsigned char)c) || strchr("._%+-", c) != NULL; }
static int is_domain(char c) { return isalnum((unsigned char)c) || c == '.' || c == '-'; }

/* If an address has its '@' at `at`, return its [start, end) in *s, *e. */
static int email_at(const char *t, size_t n, size_t at, size_t *s, size_t *e) {
    size_t a = at, b = at + 1;
    while (a > 0 && is_local(t[a - 1])) a--;
    while (b < n && is_domain(t[b])) b++;
    while (b > at + 1 && (t[b - 1] == '.' || t[b - 1] == '-')) b--; /* a sentence's full stop is not the domain */
    if (a == at || b == at + 1) return 0;
    size_t dot = b;
    while (dot > at + 1 && t[dot - 1] != '.') dot--;
    if (dot <= at + 2 || b - dot < 2) return 0; /* need name.tld with a tld of 2+ letters */
    for (size_t i = dot; i < b; i++) if (!isalpha((unsigned char)t[i])) return 0;
    *s = a; *e = b;
    return 1;
}

int main(void) {
    size_t n;
    char *t = read_all(&n);
    const char *mark = "[redacted]";
    size_t out = 0; /* start of text not yet written */
    for (size_t i = 0; i < n;) {
        size_t s, e;
        if (isdigit((unsigned char)t[i])) {
            size_t j = i;
            while (j < n && isdigit((unsigned char)t[j])) j++;
            if (j - i >= 9) {
                write_all(t + out, i - out);
                write_all(mark, strlen(mark));
                out = j;
            }
            i = j;
        } else if (t[i] == '@' && email_at(t, n, i, &s, &e) && s >= out) {
            write_all(t + out, s - out);
            write_all(mark, strlen(mark));
            out = i = e;
        } else {
            i++;
        }
    }
    write_all(t + out, n - out);
    return 0;
}
