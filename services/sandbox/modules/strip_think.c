/* strip-think: print only the final answer after the last </think> (leading whitespace dropped).
 * Text without </think> passes through unchanged. */
#include "common.h"

int main(void) {
    size_t len;
    char *text = read_all(&len);
    const char *tag = "</think>";
    const char *answer = text, *p = text;
    int found = 0;
    while ((p = strstr(p, tag)) != NULL) {
        p += strlen(tag);
        answer = p;
        found = 1;
    }
    if (found)
        while (*answer == ' ' || *answer == '\n' || *answer == '\t' || *answer == '\r') answer++;
    write_all(answer, len - (size_t)(answer - text));
    return 0;
}
