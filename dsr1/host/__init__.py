"""What loading weights does on the host, for any backend: memory in 2 MiB pages (`huge_pages`),
threaded copies compiled from C++ (`copy`, numpy where they are not built), and the build of such
C++ code (`native`: compiled on first use, cached per source, compiler and CPU)."""
