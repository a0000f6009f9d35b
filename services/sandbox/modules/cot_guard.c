/* cot-guard: screen a prompt for chain-of-thought injection.
 * Exit 0 and echo the prompt when it is clean; exit 1 with the reason on stdout when it smuggles
 * reasoning-control markup, role or system-prompt overrides, or similar. Case-insensitive. */
#include <ctype.h>
#include "common.h"

struct rule { const char *needle; const char *reason; int line_start; };

static const struct rule RULES[] = {
    {"<think>", "reasoning-control markup: <think>", 0},
    {"</think>", "reasoning-control markup: </think>", 0},
    {"<thinking", "reasoning-control markup: <thinking>", 0},
    {"<|im_start|>", "chat-template control token", 0},
    {"<|system|>", "chat-template control token", 0},
    {"<|assistant|>", "chat-template control token", 0},
    {"[inst]", "chat-template control token", 0},
    {"<<sys>>", "chat-template control token", 0},
    {"ignore previous instructions", "instruction override", 0},
    {"ignore all previous", "instruction override", 0},
    {"ignore the above", "instruction override", 0},
    {"ignore your instructions", "instruction override", 0},
    {"disregard previous", "instruction override", 0},
    {"disregard all previous", "instruction override", 0},
    {"disregard the above", "instruction override", 0},
    {"forget your instructions", "instruction override", 0},
    {"forget all previous", "instruction override", 0},
    {"override your instructions", "instruction override", 0},
    {"new instructions:", "instruction override", 0},
    {"reveal your system prompt", "system-prompt extraction", 0},
    {"print your system prompt", "system-prompt extraction", 0},
    {"repeat your system prompt", "system-prompt extraction", 0},
    {"your hidden reasoning", "reasoning extraction", 0},
    {"reveal your chain of thought", "reasoning extraction", 0},
    {"you are now dan", "role override", 0},
    {"developer mode", "role override", 0},
    {"system:", "fake system turn", 1},
    {"[system]", "fake system turn", 1},
    {"### system", "fake system turn", 1},
    {"assistant:", "fake assistant turn", 1},
};

int main(void) {
    size_t n;
    char *prompt = read_all(&n);
    char *low = malloc(n + 1);
    if (!low) return 70;
    for (size_t i = 0; i <= n; i++) low[i] = (char)tolower((unsigned char)prompt[i]);
    for (size_t r = 0; r < sizeof RULES / sizeof RULES[0]; r++) {
        const char *hit = low;
        while ((hit = strstr(hit, RULES[r].needle)) != NULL) {
            int ok = 1;
            if (RULES[r].line_start) {
                const char *q = hit;
                while (q > low && (q[-1] == ' ' || q[-1] == '\t')) q--;
                ok = (q == low || q[-1] == '\n');
            }
            if (ok) {
                printf("rejected: %s\n", RULES[r].reason);
                return 1;
            }
            hit++;
        }
    }
    write_all(prompt, n);
    return 0;
}
