"""Call-boundary mixed precision: a function or module run with its parameters
cast by filter spec (`_view`), kept layers running at their own dtype behind a
casting boundary (`_boundary`), and the wrappers users hold (`_filter_amp`).

Casting only: nothing here traces a program a second time or imports the
diagnostics, whose coverage check a first call reaches through `_first_call`."""
