#include <cstdio>
int main() { std::puts("edgetrain"); return 0; }
