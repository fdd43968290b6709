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

{{- define "molt.gatewayUrl" -}}
{{- printf "http://%s.%s:%d" (include "molt.name" (dict "root" . "component" "gateway")) (include "molt.svcDomain" .) (int .Values.gateway.port) -}}
{{- end -}}

{{- define "molt.envsUrl" -}}
{{- printf "http://%s.%s:%d" (include "molt.name" (dict "root" . "component" "envs")) (include "molt.svcDomain" .) (int .Values.envs.port) -}}
{{- end -}}

{{- define "molt.apiKeySecret" -}}
{{- .Values.gateway.apiKeys.existingSecret | default (include "molt.name" (dict "root" . "component" "api-keys")) -}}
{{- end -}}

{{/* MOLT_REDIS__URL for services that use the trajectory stream. */}}
{{- define "molt.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: MOLT_REDIS__URL
  value: {{ printf "redis://%s.%s:%d/0" (include "molt.name" (dict "root" . "component" "redis")) (include "molt.svcDomain" .) (int .Values.redis.port) | quote }}
{{- else if .Values.redis.external.existingSecret }}
- name: MOLT_REDIS__URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else if .Values.redis.external.url }}
- name: MOLT_REDIS__URL
  value: {{ .Values.redis.external.url | quote }}
{{- else }}
{{- fail "redis: set redis.enabled=true, or redis.external.url, or redis.external.existingSecret" }}
{{- end }}
{{- end -}}

{{/* Env shared by every Molt container: bind all interfaces, the chart-wide extras. */}}
{{- define "molt.commonEnv" -}}
- name: MOLT_SERVER__HOST
  value: {{ .Values.listenAddress | quote }}
- name: OMP_NUM_THREADS
  value: "1"
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "molt.modelVolume" -}}
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

{{/* HTTP probes on /healthz (liveness) and /readyz (readiness). */}}
{{- define "molt.probes" -}}
readinessProbe:
  httpGet: {path: /readyz, port: http}
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  httpGet: {path: /healthz, port: http}
  periodSeconds: 10
  failureThreshold: 6
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
