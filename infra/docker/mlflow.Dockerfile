# The MLflow tracking server of infra/k8s/mlflow.yaml: the project's MLflow version, the PostgreSQL driver for the
# backend store, boto3 for the S3-compatible artifact store and the `auth` extra for the basic-auth app. Build from the repository root:
#   docker build -f infra/docker/mlflow.Dockerfile -t <registry>/mlflow:3.17.2 .
FROM python:3.11-slim

RUN pip install --no-cache-dir "mlflow[auth]==3.17.2" "psycopg2-binary==2.9.13" "boto3==1.43.11" \
    && useradd --create-home mlflow
USER mlflow
EXPOSE 5000
ENTRYPOINT ["mlflow", "server"]
