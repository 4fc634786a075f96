"""kvchat: a multi-turn chat backend that keeps each conversation's KV cache between turns.

The one import root. The repository keeps its packages at its top level (`app/`,
`inference/`, `kernels/`, `memory/`, `history/`, `migrations/`, `bench/`); this folder maps each
of them into the namespace with a relative symlink (`kvchat/app -> ../app`), so they import as
`kvchat.app`, `kvchat.kernels`, ... in a checkout, an editable install and a wheel alike, and no
generic top-level name (`kernels`, `app`, `memory`) can collide with another installed package.
"""
