#!/usr/bin/env bash
# The main job end to end on data it makes: synthesize a plate-structured corpus, materialize it
# (from parquet and from h5ad), verify it, read cells back, then train a classifier on all plates
# but the last with the block-shuffling loader and report accuracy / macro-F1 on the held-out plate.
# On the way it queries the parquet directly (DuckDB stages, the gene index, an in-memory panel).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
CELLS="${CELLS:-20000}"
omicsio-materialize synth demo/corpus --cells "$CELLS" --seed 0
omicsio-materialize demo/corpus/cells.parquet demo/dataset --obs cell_type,drug,batch --overwrite
omicsio-materialize demo/corpus/cells.h5ad demo/dataset_h5ad --obs drug --overwrite --no-progress
omicsio-materialize verify demo/dataset
python - <<'PY'
import numpy as np
import omicsio_jax as oj

ds = oj.open_dataset("demo/dataset")
print(ds)
indptr, indices, values = ds.read_csr([3, 0, 17])
drug = ds.obs["drug"]
print(f"cells 3, 0, 17: {np.diff(indptr).tolist()} nonzeros; drugs {drug.labels()[[3, 0, 17]].tolist()}")
h5 = oj.open_dataset("demo/dataset_h5ad")
same = all(np.array_equal(a, b) for a, b in zip(h5.read_csr(range(100)), ds.read_csr(range(100))))
print(f"h5ad and parquet inputs give identical cells: {same}")

# Grain's DataLoader over the dataset serves make_loader's batches; every epoch is audited
kw = dict(batch_size=256, sampling=oj.Block(fetch_factor=16), seed=0, num_epochs=1, obs=("drug",))
loader = oj.make_loader(ds, **kw)
grain_loader = oj.make_grain_loader(ds, **kw)
equal = all(np.array_equal(np.asarray(a.index), b.index) for a, b in zip(loader, grain_loader, strict=True))
print(f"grain.DataLoader batches equal make_loader's: {equal}; epoch audit: {loader.coverage(0).to_dict()}")
PY
# several modalities of the same cells: RNA, its splice layers and ATAC (in another order, some cells
# without it), aligned by cell_id; one loader gives every modality of the same cells
omicsio-materialize synth demo/multiome --cells 4000 --peaks 50000 --multimodal --no-h5ad --no-progress --seed 0
omicsio-materialize demo/multiome/cells.parquet demo/multiome_dataset --overwrite --no-progress --obs cell_type \
    --layers spliced=demo/multiome/rna_layers_spliced.parquet,unspliced=demo/multiome/rna_layers_unspliced.parquet \
    --modality atac=demo/multiome/atac_cells.parquet
omicsio-materialize verify demo/multiome_dataset
python - <<'PY'
import numpy as np
import omicsio_jax as oj

ds = oj.open_dataset("demo/multiome_dataset")
print(f"modalities {ds.modalities}; {int(np.sum(ds.obs['has_atac']))} of {ds.num_cells} cells have ATAC "
      f"over {ds.modality('atac').num_genes:,} peaks")
loader = oj.make_loader(ds, batch_size=256, seed=0, num_epochs=1,
                        output={"rna": "dense", "spliced": "csr", "unspliced": "csr", "atac": "csr"})
batch = next(iter(loader))
rows = np.asarray(batch.index)
indptr, peaks, counts = ds.read_csr(rows, modality="atac")
atac = np.asarray(loader.densify(batch.x["atac"], "atac"))
want = np.zeros_like(atac)
for i in range(len(rows)):
    want[i, peaks[indptr[i]:indptr[i + 1]]] = counts[indptr[i]:indptr[i + 1]]
print(f"one batch of every modality: rna {batch.x['rna'].shape}, atac {atac.shape}; "
      f"atac equals read_csr of the same cells: {bool(np.array_equal(atac, want))}")
PY
omicsio-materialize index demo/corpus/cells.parquet demo/index --overwrite --no-progress
python - <<'PY'
import omicsio_jax as oj

table = oj.open_table("demo/corpus/cells.parquet", index="demo/index")
lung = table.select("tissue = 'lung'")
top = table.sql("SELECT gene_token_id, sum(len(cell_rowids)) AS n FROM gene_cell_index GROUP BY 1 ORDER BY n DESC")
top = top.column("gene_token_id").to_numpy()
genes = table.genes.names(top[5:7])
hits = table.cells_expressing(genes, mode="all", rowids=lung)
assert (hits == table.cells_expressing(genes, mode="all", rowids=lung, use_index=False)).all()
panel = table.panel(genes, rowids=hits[:5])
print(f"{len(lung)} lung cells; {len(hits)} express {' and '.join(genes)}; their expression:\n{panel.x}")
data = oj.load_panel(table, top[:2000], obs=("drug",), progress=False)   # the 2,000 most detected genes
loader = oj.make_memory_loader(data, batch_size=1024, seed=0)
print(f"in-memory 2,000-gene panel {data.x.shape}: {sum(1 for _ in loader)} batches of 1,024 per epoch")
PY
# the last plate holds every label: hold it out
LAST=$(python -c "import omicsio_jax as oj; print(oj.open_dataset('demo/dataset').obs['batch'].categories[-1])")
rm -rf demo/ckpt
omicsio-train demo/dataset --label cell_type --model mlp --batch-size 256 --block-size 16 --fetch-factor 64 \
    --sampling block --epochs 1 --seed 0 --eval-where "batch = '$LAST'" \
    --checkpoint-dir demo/ckpt --checkpoint-every 25 --log-every 20
