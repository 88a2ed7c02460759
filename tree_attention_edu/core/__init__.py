"""The algorithm, and nothing else: it imports only JAX and numpy.

A student's path through it, top to bottom:

1. `numerics`: the safe-softmax pieces (shifts, double-word log-sum-exps);
2. `masks`: which keys a query may see, from global positions;
3. `reference`: plain softmax attention on one device, the definition;
4. `states`: a chunk's partial state `(out, lse)` and `combine`, the monoid;
5. `merges`: the same algebra across devices (Algorithm 3 and today's patterns);
6. `kernels`: the local kernel that turns one device's shard into a state;
7. `decode`: q, k, v → local kernel → state → merge → output, on a mesh;
8. `devices`: simulated devices, meshes, `pad_cache`.

`inputs` and `validate` hold the argument checks every module shares.
"""
