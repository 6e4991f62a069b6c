// Bindings of hp::ckpt (checkpoint byte I/O). Bindings only: the logic lives
// in csrc/checkpoint. Errors surface as RuntimeError; hyperparallel.checkpoint
// turns them into CheckpointError.
#include <torch/extension.h>

#include "hyperparallel/checkpoint/io.h"
#include "module.h"

namespace py = pybind11;
using namespace hp;

namespace {

const void* cpu_bytes(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what,
              ": expected a contiguous CPU tensor; call .contiguous().cpu() first");
  return t.data_ptr();
}

void bind_checkpoint(py::module_& m) {
  py::class_<ckpt::FileWriter>(m, "CkptFileWriter",
                                "A data file written as items come (hp::ckpt::FileWriter): append(items), then finish().")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def(
          "append",
          [](ckpt::FileWriter& writer, const py::list& entries) {
            // Keep tensors and bytes alive while the GIL is released.
            std::vector<at::Tensor> tensors;
            std::vector<std::string> blobs;
            tensors.reserve(entries.size());
            blobs.reserve(entries.size());
            std::vector<ckpt::WriteItem> items;
            for (const auto& entry : entries) {
              auto tuple = entry.cast<py::tuple>();
              ckpt::WriteItem item;
              if (py::isinstance<py::bytes>(tuple[0])) {
                blobs.push_back(tuple[0].cast<std::string>());
                item.data = blobs.back().data();
                item.nbytes = blobs.back().size();
              } else if (tuple.size() == 1) {  // a tensor's raw bytes (safetensors)
                tensors.push_back(tuple[0].cast<at::Tensor>());
                item.data = cpu_bytes(tensors.back(), "hp.checkpoint save");
                item.nbytes = uint64_t(tensors.back().nbytes());
              } else {
                tensors.push_back(tuple[0].cast<at::Tensor>());
                const at::Tensor& t = tensors.back();
                item.is_tensor = true;
                item.storage_type = tuple[1].cast<std::string>();
                item.shape = t.sizes().vec();
                item.data = cpu_bytes(t, "hp.checkpoint save");
                item.nbytes = uint64_t(t.nbytes());
              }
              items.push_back(std::move(item));
            }
            std::vector<ckpt::ItemExtent> written;
            {
              py::gil_scoped_release no_gil;
              written = writer.append(items);
            }
            py::list extents;
            for (const auto& e : written) extents.append(py::make_tuple(e.offset, e.length));
            return extents;
          },
          py::arg("items"),
          "Writes items [(bytes,) | (tensor,) raw | (tensor, storage_type) as torch.save] after those before; "
          "returns [(offset, length)].")
      .def(
          "finish",
          [](ckpt::FileWriter& writer) {
            ckpt::FileDigest digest;
            {
              py::gil_scoped_release no_gil;
              digest = writer.finish();
            }
            return py::make_tuple(digest.size, digest.crc32);
          },
          "fsyncs and closes the file; returns (size, crc32).");
  m.def(
      "ckpt_torch_save_bytes",
      [](const std::string& storage_type, const at::Tensor& t) {
        return py::bytes(ckpt::torch_save_bytes(storage_type, t.sizes().vec(), cpu_bytes(t, "torch_save_bytes"),
                                                uint64_t(t.nbytes())));
      },
      py::arg("storage_type"), py::arg("tensor"));
  m.def(
      "ckpt_records",
      [](const std::string& path, uint64_t offset, uint64_t length) {
        std::map<std::string, ckpt::Record> records;
        {
          py::gil_scoped_release no_gil;
          records = ckpt::torch_save_records(path, offset, length);
        }
        py::dict out;
        for (const auto& [name, r] : records) out[py::str(name)] = py::make_tuple(r.offset, r.size, r.crc32);
        return out;
      },
      py::arg("path"), py::arg("offset"), py::arg("length"));
  m.def(
      "ckpt_read_bytes",
      [](const std::string& path, uint64_t offset, uint64_t n) {
        std::string data;
        {
          py::gil_scoped_release no_gil;
          data = ckpt::read_bytes(path, offset, n);
        }
        return py::bytes(data);
      },
      py::arg("path"), py::arg("offset"), py::arg("nbytes"));
  m.def(
      "ckpt_read_into",
      [](const std::vector<std::tuple<std::string, uint64_t, at::Tensor>>& requests, int threads) {
        std::vector<ckpt::ReadRequest> reads;
        for (const auto& [path, offset, t] : requests)
          reads.push_back({path, offset, uint64_t(t.nbytes()), const_cast<void*>(cpu_bytes(t, "hp.checkpoint load"))});
        py::gil_scoped_release no_gil;
        ckpt::read_into(reads, threads);
      },
      py::arg("requests"), py::arg("threads"), "Reads [(path, offset, tensor)]: tensor.nbytes bytes at offset into tensor.");
  m.def(
      "ckpt_digest_file",
      [](const std::string& path, int threads) {
        ckpt::FileDigest d;
        {
          py::gil_scoped_release no_gil;
          d = ckpt::digest_file(path, threads);
        }
        return py::make_tuple(d.size, d.crc32);
      },
      py::arg("path"), py::arg("threads"));
  m.def(
      "ckpt_crc32", [](const py::bytes& data, uint32_t crc) {
        std::string_view view(data);
        return ckpt::crc32(view.data(), view.size(), crc);
      },
      py::arg("data"), py::arg("crc") = 0);
  m.def("ckpt_crc32_combine", &ckpt::crc32_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("length_b"));
  m.def("ckpt_fsync_dir", &ckpt::fsync_dir, py::arg("path"), py::call_guard<py::gil_scoped_release>());
  m.def("ckpt_publish_dir", &ckpt::publish_dir, py::arg("staged"), py::arg("target"),
        py::call_guard<py::gil_scoped_release>());
}

hp::python::Registrar registrar("checkpoint", &bind_checkpoint);

}  // namespace
