# The kvchat service. TORCH_SPEC picks the torch build: the CPU wheel by default, a CUDA one
# for GPU hosts (e.g. --build-arg TORCH_SPEC="torch==2.11.0" with the CUDA index).
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
WORKDIR /app
RUN pip install --no-cache-dir "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md alembic.ini constraints.txt ./
COPY kvchat kvchat
COPY app app
COPY inference inference
COPY kernels kernels
COPY memory memory
COPY history history
COPY migrations migrations
COPY bench bench
# A wheel install (not editable): kvchat/ symlinks the folders above into the kvchat namespace.
RUN pip install --no-cache-dir -c constraints.txt . && rm -rf build
ENV PYTHONSAFEPATH=1
ENV KVCHAT_HOST=0.0.0.0 KVCHAT_PORT=8000 KVCHAT_MODEL=/models/smollm2-135m-instruct KVCHAT_DATA_DIR=/data
EXPOSE 8000
CMD ["sh", "-c", "kvchat db upgrade && kvchat serve"]
