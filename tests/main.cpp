// main.cpp: the Catch2 main shared by the CPU test suites.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
