{{/* Names, labels, URLs and shared pod fragments. */}}

{{- define "molt.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: molt.name (dict "root" $ "component" "gateway") */}}
{{- define "molt.name" -}}
{{- printf "%s-%s" (include "molt.fullname" .root) .component -}}
{{- end -}}

{{- define "molt.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "molt.labels" -}}
{{ include "molt.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* image: molt.image (dict "root" $ "image" .Values.gateway.image) */}}
{{- define "molt.image" -}}
{{- $repo := .image.repository -}}
{{- if .root.Values.imageRegistry -}}{{- $repo = printf "%s/%s" .root.Values.imageRegistry $repo -}}{{- end -}}
{{- printf "%s:%s" $repo (.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}

{{- define "molt.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* One URL per rollout pod: the gateway routes sessions to pods, so it needs each by name. */}}
{{- define "molt.rolloutUrls" -}}
{{- $name := include "molt.name" (dict "root" . "component" "rollout") -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.rollout.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s:%d" $name $i $name (include "molt.svcDomain" $) (int $.Values.rollout.httpPort)) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}

{{/* The rollout URLs the gateway routes to: the chart's pods, or gateway.rolloutUrls when it has none. */}}
{{- define "molt.gatewayRolloutUrls" -}}
{{- if .Values.rollout.enabled -}}
{{- if .Values.gateway.rolloutUrls -}}
{{- fail "gateway.rolloutUrls is only for rollout.enabled=false: the gateway routes to the chart's rollout pods" -}}
{{- end -}}
{{- include "molt.rolloutUrls" . -}}
{{- else if .Values.gateway.rolloutUrls -}}
{{- join "," .Values.gateway.rolloutUrls -}}
{{- else -}}
{{- fail "rollout.enabled=false: set gateway.rolloutUrls to the base URL of every rollout pod the gateway routes to (e.g. {http://vllm-0.vllm.rl.svc:8000,http://vllm-1.vllm.rl.svc:8000}), or gateway.enabled=false" -}}
{{- end -}}
{{- end -}}

{{- define "molt.gatewayUrl" -}}
{{- printf "http://%s.%s:%d" (include "molt.name" (dict "root" . "component" "gateway")) (include "molt.svcDomain" .) (int .Values.gateway.port) -}}
{{- end -}}

{{- define "molt.envsUrl" -}}
{{- printf "http://%s.%s:%d" (include "molt.name" (dict "root" . "component" "envs")) (include "molt.svcDomain" .) (int .Values.envs.port) -}}
{{- end -}}

{{- define "molt.apiKeySecret" -}}
{{- .Values.gateway.apiKeys.existingSecret | default (include "molt.name" (dict "root" . "component" "api-keys")) -}}
{{- end -}}

{{- define "molt.redisSecret" -}}
{{- .Values.redis.auth.existingSecret | default (include "molt.name" (dict "root" . "component" "redis")) -}}
{{- end -}}

{{/* MOLT_REDIS__URL for services that use the trajectory stream. In-chart Redis requires a password:
REDIS_PASSWORD comes from the Secret and Kubernetes expands $(REDIS_PASSWORD) into the URL. */}}
{{- define "molt.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "molt.redisSecret" . }}, key: {{ .Values.redis.auth.existingSecretKey }}}
- name: MOLT_REDIS__URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s.%s:%d/0" (include "molt.name" (dict "root" . "component" "redis")) (include "molt.svcDomain" .) (int .Values.redis.port) | quote }}
{{- else if .Values.redis.external.existingSecret }}
- name: MOLT_REDIS__URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else if .Values.redis.external.url }}
# From the chart's Secret, not a plain value: the URL may carry a password, and pod specs are readable by
# more people (kubectl get pod -o yaml) than Secrets are.
- name: MOLT_REDIS__URL
  valueFrom:
    secretKeyRef: {name: {{ include "molt.name" (dict "root" . "component" "redis-external") }}, key: url}
{{- else }}
{{- fail "redis: set redis.enabled=true, or redis.external.url, or redis.external.existingSecret" }}
{{- end }}
{{- end -}}

{{- define "molt.weightsSecret" -}}
{{- .Values.weightSync.existingSecret | default (include "molt.name" (dict "root" . "component" "weights")) -}}
{{- end -}}

{{/* The weight-sync token rollout pods require and the trainer sends (gRPC and the HTTP reload). */}}
{{- define "molt.weightsTokenEnv" -}}
- name: MOLT_WEIGHTS_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "molt.weightsSecret" . }}, key: MOLT_WEIGHTS_TOKEN}
{{- end -}}

{{- define "molt.internalSecret" -}}
{{- .Values.internalToken.existingSecret | default (include "molt.name" (dict "root" . "component" "internal")) -}}
{{- end -}}

{{/* The service token (MOLT_INTERNAL_TOKEN) rollout pods and env workers require on every route but the
probes and /metrics; the gateway sends it to the pods, the trainer to the env workers. */}}
{{- define "molt.internalTokenEnv" -}}
- name: MOLT_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "molt.internalSecret" . }}, key: MOLT_INTERNAL_TOKEN}
{{- end -}}

{{/* Where the optional weight-sync TLS Secret (weightSync.tlsSecret) is mounted. */}}
{{- define "molt.weightsTlsDir" -}}/etc/molt/weights-tls{{- end -}}

{{/* Env shared by every Molt container: bind all interfaces, caches under the writable /tmp (the
root filesystem is read-only), the chart-wide extras. */}}
{{- define "molt.commonEnv" -}}
- name: MOLT_SERVER__HOST
  value: {{ .Values.listenAddress | quote }}
- name: OMP_NUM_THREADS
  value: "1"
- name: HOME
  value: /tmp/home
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod-level settings of every pod: its ServiceAccount (no API token), non-root, seccomp (the chart-wide
type, or a component's own seccompProfile object): molt.podSecurity (dict "root" $ "seccomp" $v.seccompProfile) */}}
{{- define "molt.podSecurity" -}}
{{- $root := .root -}}
serviceAccountName: {{ include "molt.serviceAccount" $root }}
automountServiceAccountToken: false
securityContext:
  runAsNonRoot: true
  runAsUser: {{ $root.Values.securityContext.runAsUser }}
  runAsGroup: {{ $root.Values.securityContext.runAsGroup }}
  fsGroup: {{ $root.Values.securityContext.fsGroup }}
  {{- if .seccomp }}
  seccompProfile: {{- toYaml .seccomp | nindent 4 }}
  {{- else }}
  seccompProfile: {type: {{ $root.Values.securityContext.seccompProfile }}}
  {{- end }}
{{- end -}}

{{/* Container-level: read-only root filesystem, no privilege escalation, no capabilities but those a
GPU component lists in addCapabilities (e.g. IPC_LOCK for RDMA memory registration):
molt.containerSecurity (dict "add" $v.addCapabilities); any other context adds none. */}}
{{- define "molt.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  {{- if and (kindIs "map" .) .add }}
  capabilities: {drop: [ALL], add: {{ toJson .add }}}
  {{- else }}
  capabilities: {drop: [ALL]}
  {{- end }}
{{- end -}}

{{- define "molt.serviceAccount" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "molt.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* The checkpoint volume: an existing claim or the chart's own PVC (never emptyDir: the model is kept). */}}
{{- define "molt.checkpointClaim" -}}
{{- .Values.trainer.checkpoints.existingClaim | default (include "molt.name" (dict "root" . "component" "checkpoints")) -}}
{{- end -}}

{{/* A PodDisruptionBudget: molt.pdb (dict "root" $ "component" "gateway") */}}
{{- define "molt.pdb" -}}
{{- if .root.Values.podDisruptionBudget.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "molt.name" . }}
  labels: {{- include "molt.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .root.Values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels: {{- include "molt.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{- define "molt.modelVolume" -}}
{{- /* Every pod that loads the model fails to start without it: refuse the render instead. */}}
{{- with include "molt.notMounted" (dict "path" .Values.model.path "key" "model.path" "mounts" (list .Values.model.mountPath) "extra" .Values.extraVolumeMounts) }}{{ fail . }}{{ end -}}
- name: model
{{- if .Values.model.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
    readOnly: true
{{- else if .Values.model.hostPath }}
  hostPath:
    path: {{ .Values.model.hostPath }}
    type: Directory
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* Volumes and mounts a platform engineer adds (a PVC or hostPath with data files, a reward model,
the model at the launching machine's path that `molt train-rl --emit helm-values` wrote): the chart-wide
extraVolumes/extraVolumeMounts go to every Molt pod, a component's own to its pods only.
molt.extraVolumes / molt.extraVolumeMounts (dict "root" $ "v" $v "indent" N): nothing when there are none. */}}
{{- define "molt.extraVolumes" -}}
{{- with concat .root.Values.extraVolumes (.v.extraVolumes | default list) }}
{{- toYaml . | nindent $.indent }}
{{- end }}
{{- end -}}

{{- define "molt.extraVolumeMounts" -}}
{{- with concat .root.Values.extraVolumeMounts (.v.extraVolumeMounts | default list) }}
{{- toYaml . | nindent $.indent }}
{{- end }}
{{- end -}}

{{/* Why absolute PATH is not under any directory the container mounts (MOUNTS, and EXTRA's mountPaths), or
"": emitted values carry paths of the machine that ran `molt train-rl`, which pods see only if mounted.
molt.notMounted (dict "path" P "key" "model.path" "mounts" (list DIR...) "extra" (list MOUNT...)) */}}
{{- define "molt.notMounted" -}}
{{- if hasPrefix "/" .path -}}
{{- $ok := false -}}
{{- $mounts := .mounts -}}
{{- range .extra -}}{{- $mounts = append $mounts .mountPath -}}{{- end -}}
{{- range $mounts -}}
{{- $m := trimSuffix "/" . -}}
{{- if or (eq $.path $m) (hasPrefix (printf "%s/" $m) $.path) -}}{{- $ok = true -}}{{- end -}}
{{- end -}}
{{- if not $ok -}}
{{- printf "%s=%s is not under any volume the pods mount (%s): set model.mountPath (with model.existingClaim or model.hostPath) to a directory above it, or mount it with extraVolumes/extraVolumeMounts (docs/deploy.md)" .key .path (join ", " $mounts | default "none") -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* HTTP probes on /healthz (liveness) and /readyz (readiness). Given a dict with "livenessFailures", the
liveness probe restarts the container after that many failures 10 s apart (else 6). */}}
{{- define "molt.probes" -}}
readinessProbe:
  httpGet: {path: /readyz, port: http}
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  httpGet: {path: /healthz, port: http}
  periodSeconds: 10
  failureThreshold: {{ get . "livenessFailures" | default 6 }}
{{- end -}}

{{/* The value ARGS give FLAG, as --flag=VALUE or --flag VALUE ("" when they do not).
molt.flagValue (dict "args" (list ARG...) "flag" "--section.field") */}}
{{- define "molt.flagValue" -}}
{{- $found := "" -}}
{{- range $i, $a := .args -}}
{{- if hasPrefix (printf "%s=" $.flag) (toString $a) -}}
{{- $found = trimPrefix (printf "%s=" $.flag) (toString $a) -}}
{{- else if and (eq (toString $a) $.flag) (lt (add1 $i) (len $.args)) -}}
{{- $found = toString (index $.args (add1 $i)) -}}
{{- end -}}
{{- end -}}
{{- $found -}}
{{- end -}}

{{/* Render ServiceMonitor / PrometheusRule only where the Prometheus Operator CRDs are served. */}}
{{- define "molt.monitoring" -}}
{{- $m := .Values.monitoring.enabled -}}
{{- if eq (toString $m) "auto" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- else if $m -}}true{{- end -}}
{{- end -}}

{{- define "molt.podScheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Probe of the trainer: node 0 (global rank 0) answers PATH on the metrics port; other nodes have no
HTTP server, and their torchrun agent (PID 1) being up is the check. */}}
{{- define "molt.trainerProbe" -}}
import os, urllib.request; os.environ["NODE_RANK"] != "0" or urllib.request.urlopen("http://localhost:{{ .port }}{{ .path }}", timeout=5)
{{- end -}}
