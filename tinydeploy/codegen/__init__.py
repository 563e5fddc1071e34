"""C code generation: a planned graph -> a self-contained C project (see `project.generate`)."""
